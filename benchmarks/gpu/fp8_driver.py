"""The FP8 calls for compute-sanitizer (sanitizer_driver.py runs them after the GEMMs and
the expert layer): every FP8 kernel of the core through groupgemm.torch, on FP8 cases of
the shared table, each result checked against the CPU backend's for the same call.

- The quantization kernels (rows, 1 x 128 tiles, 128 x 128 blocks, the grouped token
  blocks and their setup kernel) run on any GPU and must give the CPU's bits.
- On a compute capability 9.0 GPU the scaled grouped GEMMs run too, both recipes, both
  forms (the setup kernel with its row and group fills, the token-block, scale layout and
  token alignment kernels and the four sm_90a FP8 GEMM instantiations: e4m3 or e5m2 A,
  bfloat16 or float32 output):
  within the tensor cores' summation order of the CPU's float32 sums, with padding rows
  and empty groups exact zeros and an accumulator's empty groups left bit for bit.
- Elsewhere the scaled GEMMs must refuse with the FP8 tensor-core requirement.
"""

import dataclasses

import numpy as np
import reference
from cases import CASES, Case
from fp8_reference import RECIPES, inputs

from groupgemm import _contract as contract

# Relative to the result's scale: the CPU's float32 sums against the tensor cores' order.
TOLERANCE = {"bfloat16": 8e-3, "float32": 1e-4}
EXTRA_CASES = [Case("long_groups", 700, 32, 16, (300, 0, 129, 1, 0, 270))]  # groups of several token blocks
ALL_FP8_CASES = {c.name: c for c in CASES + EXTRA_CASES}
QUICK_FP8_CASES = ("skewed", "all_empty", "window_middle", "long_groups")


@dataclasses.dataclass(frozen=True)
class Fp8Call:
    name: str
    recipe: str
    lhs_dtype: str = "float8_e4m3fn"
    out_dtype: str = "bfloat16"
    bias: bool = False
    accumulate: bool = False
    gemm: bool = True  # False: the quantizations only


def planned_calls(hopper):
    """The calls of one case: the quantizations, and (Hopper) every GEMM instantiation."""
    calls = [Fp8Call(f"quantize/{r}", r, gemm=False) for r in RECIPES]
    if hopper:
        for r in RECIPES:
            calls += [Fp8Call(f"forward/{r}/e4m3/bfloat16", r), Fp8Call(f"forward/{r}/e5m2/float32/bias", r,
                                                                        "float8_e5m2", "float32", bias=True),
                      Fp8Call(f"wgrad/{r}/e5m2/bfloat16", r, "float8_e5m2"),
                      Fp8Call(f"wgrad/{r}/e4m3/accumulate", r, out_dtype="float32", accumulate=True)]
    return calls


def run_call(torch, gt, call, case, device):
    """The call's results on `device`, as host tensors in call order."""
    x = inputs(case)

    def t(values, dtype):
        return torch.from_numpy(np.ascontiguousarray(values)).to(device=device, dtype=getattr(torch, dtype))

    sizes = t(x["group_sizes"], "int32")
    grouped = dict(num_groups=case.g, group_offset=case.group_offset)
    qx, sx = gt.quantize_fp8(t(x["x"], "bfloat16"), call.recipe, dtype=getattr(torch, call.lhs_dtype))
    qw, sw = gt.quantize_fp8(t(x["w"], "bfloat16"), call.recipe)
    qd, sd = gt.quantize_fp8_grouped(t(x["dout"], "bfloat16"), sizes, call.recipe,
                                     dtype=getattr(torch, call.lhs_dtype), **grouped)
    qxt, sxt = gt.quantize_fp8_grouped(t(x["x"], "bfloat16"), sizes, call.recipe, **grouped)
    results = [qx, sx, qw, sw, qd, sd, qxt, sxt]
    if not call.gemm:
        return results
    if call.name.startswith("forward"):
        pair = contract.torch_fp8_scalings("2d-3d", call.recipe)
        bias = t(x["bias"], call.out_dtype) if call.bias else None
        out = gt.scaled_grouped_mm(qx, qw.transpose(-2, -1), sx, pair[0], sw, pair[1], bias=bias,
                                   output_dtype=getattr(torch, call.out_dtype), group_sizes=sizes,
                                   group_offset=case.group_offset)
    else:
        pair = contract.torch_fp8_scalings("2d-2d", call.recipe)
        acc = t(x["acc"], "float32") if call.accumulate else None
        out = gt.scaled_grouped_mm(qd, qxt.t(), sd, pair[0], sxt, pair[1], output_dtype=getattr(torch, call.out_dtype),
                                   group_sizes=sizes, accumulate_into=acc, **grouped)
    return results + [out]


def exact_entries(call, case, shape):
    """Entries no GEMM writes: padding rows (forward), empty groups (weight gradient)."""
    sizes = np.asarray(case.group_sizes)
    mask = np.zeros(shape, bool)
    if call.name.startswith("forward"):
        mask[reference.padding_rows(sizes, case.m, case.g, case.offset)] = True
    else:
        mask[reference.empty_groups(sizes, case.m, case.g, case.offset)] = True
    return mask


def mismatch(torch, call, case, gpu, cpu):
    """Why the GPU's results differ from the CPU's, or None."""
    for i, (g, c) in enumerate(zip(gpu, cpu)):
        g, c = g.cpu(), c.cpu()
        if i < 8:  # quantized values and scales: bit for bit
            if not torch.equal(g.view(torch.uint8), c.view(torch.uint8)):
                return f"quantized result {i} differs from the CPU backend's bits"
            continue
        got, want = g.double().numpy(), c.double().numpy()
        exact = exact_entries(call, case, want.shape)
        if not np.array_equal(got[exact], want[exact]):
            return "entries no GEMM writes (padding rows, empty groups, an untouched accumulator) changed"
        scale = max(1e-30, float(np.abs(want).max(initial=0.0)))
        error = float(np.abs(got - want).max(initial=0.0))
        if not np.isfinite(error) or error > TOLERANCE[call.out_dtype] * scale:
            return f"max error {error:.3g} > {TOLERANCE[call.out_dtype]:g} x scale {scale:.3g}"
    return None


def run(torch, names, hopper, device="cuda"):
    """Runs the FP8 calls of the named cases; returns (calls, [failure labels with their problem])."""
    import groupgemm.torch as gt

    count, failures = 0, []
    for name in names:
        case = ALL_FP8_CASES[name]
        for call in planned_calls(hopper):
            count += 1
            label = f"fp8/{case.name}/{call.name}"
            try:
                problem = mismatch(torch, call, case, run_call(torch, gt, call, case, device),
                                   run_call(torch, gt, call, case, "cpu"))
            except (RuntimeError, ValueError, TypeError) as exc:
                problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if problem:
                failures.append(f"{label}: {problem}")
        if not hopper and device == "cuda":
            count += 1
            try:
                run_call(torch, gt, Fp8Call("forward/refused", "rowwise"), case, device)
                failures.append(f"fp8/{case.name}/forward: ran on a GPU without FP8 tensor cores")
            except NotImplementedError as exc:
                if "need FP8 tensor cores" not in str(exc):
                    failures.append(f"fp8/{case.name}/forward: refused without naming the requirement: {exc}")
    return count, failures
