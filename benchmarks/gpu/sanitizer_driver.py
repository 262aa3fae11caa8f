"""Calls every CUDA kernel of the core through groupgemm._core, for compute-sanitizer.

Each call hands torch CUDA tensors to the core the way the PyTorch frontend does (DLPack
capsules, a uint8 workspace of _core.workspace_bytes(...) bytes, the current stream) and
checks the result against the float64 NumPy reference of the tests (tests/reference.py)
on the shared case table (tests/cases.py) plus multi-tile and unaligned shapes: values,
exact-zero padding rows and empty groups, accumulators left bit-for-bit. The expert
layer's kernels (permute, unpermute and its backward, the activations) run on routing
cases and are checked against the CPU backend's results for the same calls
(expert_driver.py), the fused expert MLP's on its own cases (expert_mlp_driver.py), and the
FP8 kernels against the CPU backend too (fp8_driver.py:
quantization bit for bit, and on Hopper the FP8 GEMMs). The only device work besides the core's kernels is copies (and
unpermute's backward's own memset), so what the sanitizer reports is the core's. At the
end it checks that every kernel and CUTLASS instantiation was reached (driver_calls.py).
On a compute capability 9.0 GPU the GEMM calls run once per kernel family
(GROUPGEMM_CUDA_KERNEL=sm80, then each sm90 tile), so the sanitizer sees every 3.x kernel too,
and the fused expert MLP's cases that reach A's gathered rows run again under "sm90", its
sm_90a gathered GEMM.
Exit status: 0 all good, 1 a mismatch or a kernel not reached, 3 no CUDA GPU (or no torch).

    compute-sanitizer --tool memcheck python3 benchmarks/gpu/sanitizer_driver.py --quick
"""

import argparse
import itertools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests")
sys.path[:0] = [HERE, os.path.join(TESTS, "helpers"), TESTS]  # the tests' case table and reference

import expert_driver as expert  # noqa: E402
import expert_mlp_driver as mlp  # noqa: E402
import fp8_driver as fp8  # noqa: E402
import numpy as np  # noqa: E402
import reference  # noqa: E402
from cases import CASES, Case, inputs, round_to  # noqa: E402
from contenders import set_kernel_family  # noqa: E402
from driver_calls import (  # noqa: E402
    DEFAULT_KERNEL,
    DTYPES,
    FAMILIES,
    GATHERED_SM90,
    calls_for,
    describe,
    families_on,
    kernels_reached,
    mlp_families_on,
    required_expert_kernels,
    required_expert_mlp_kernels,
    required_kernels,
)

NO_GPU_EXIT = 3
# Largest error allowed relative to the result's scale, per input dtype (the tests' values).
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
EXTRA_CASES = [
    Case("tiles", 1000, 256, 136, (300, 0, 129, 1, 0, 400, 170, 0)),  # several tiles per group, N past a tile edge
    Case("tiles_window", 700, 64, 256, (100, 200, 0, 300, 100), num_groups=3, group_offset=1),
    Case("unaligned_k", 200, 36, 24, (50, 0, 100, 50)),  # K not a multiple of 8
    Case("unaligned_n", 200, 32, 20, (50, 0, 100, 50)),  # N not a multiple of 8
]
ALL_CASES = {c.name: c for c in CASES + EXTRA_CASES}
# Still every kernel and instantiation (tests/test_gpu_kit.py checks), in a third of the calls.
QUICK_CASES = ("skewed", "all_empty", "sum_above_rows", "negative_size", "window_past_end", "zero_k", "tiles_window",
               "unaligned_k", "unaligned_n")
INT_PREFILL = 0x5EED5EED  # int32 outputs before a call (a value no kernel writes)
STICKY = ("illegal", "misaligned address", "unspecified launch failure", "an earlier CUDA error")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"only {len(QUICK_CASES)} cases (still every kernel)")
    p.add_argument("--prefill", choices=["nan", "empty"], default="nan",
                   help="outputs filled with NaN (a row no kernel writes fails the check) or left "
                        "uninitialised (for initcheck)")
    p.add_argument("--cases", nargs="+", choices=sorted(ALL_CASES),
                   help="run only these GEMM cases (and the expert-layer cases named by --expert-cases)")
    p.add_argument("--expert-cases", nargs="+", choices=sorted(expert.ALL_EXPERT_CASES),
                   help="run only these expert-layer cases (and the GEMM cases named by --cases)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu rehearses the same calls and checks on the CPU backend (no kernel is reached)")
    p.add_argument("--part", default="all", metavar="PART", choices=["all", "layer", *FAMILIES],
                   help="all (default); one GEMM kernel family alone (" + ", ".join(FAMILIES) + "); or layer: "
                        "the expert-layer and FP8 kernels alone. The GPU kit runs the parts side by side, "
                        "and a part's verdict names its family")
    return p.parse_args(argv)


class Device:
    """Tensors on the GPU made by copies only, and the core's calling convention."""

    def __init__(self, torch, core, name="cuda"):
        from torch.utils.dlpack import to_dlpack

        self.torch, self.core, self.to_dlpack, self.name = torch, core, to_dlpack, name
        self.dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

    def tensor(self, array, dtype, offset=0):
        """`array` rounded to `dtype` on the host, then copied; with `offset`, a view that
        starts `offset` elements into its device storage."""
        host = self.torch.from_numpy(np.ascontiguousarray(array, np.float64)).to(self.dtypes[dtype])
        if not offset:
            return host.to(self.name)
        flat = self.torch.zeros(host.numel() + offset, dtype=host.dtype)
        flat[offset:] = host.reshape(-1)
        return flat.to(self.name)[offset:].view(host.shape)

    def index(self, values, dtype):
        return self.torch.from_numpy(np.asarray(values, dtype)).to(self.name)

    def output(self, shape, dtype, prefill):
        if prefill == "empty":
            return self.torch.empty(shape, dtype=self.dtypes[dtype], device=self.name)
        return self.torch.full(shape, float("nan"), dtype=self.dtypes[dtype]).to(self.name)

    def int_output(self, shape, prefill):
        """An int32 output: uninitialised, or filled with a value no kernel writes."""
        if prefill == "empty":
            return self.torch.empty(shape, dtype=self.torch.int32, device=self.name)
        return self.torch.full(shape, INT_PREFILL, dtype=self.torch.int32).to(self.name)

    def permute_workspace(self, slots, experts):
        if self.name == "cpu":
            return None
        nbytes = self.core.permute_workspace_bytes(self.core.Device.cuda, slots, experts)
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.name)

    def unpermute_backward_workspace(self, slots):
        if self.name == "cpu":
            return None
        nbytes = self.core.unpermute_backward_workspace_bytes(self.core.Device.cuda, slots)
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.name)

    def fetch(self, t):
        """t on the host, as it is (raw bits kept)."""
        if self.name == "cuda":
            self.torch.cuda.synchronize()
        return t.cpu()

    def workspace(self, groups):
        if self.name == "cpu":
            return None  # the CPU backend needs none
        # workspace_bytes takes _core.Device.cuda; builds before that enum took True for CUDA.
        cuda = self.core.Device.cuda if hasattr(self.core, "Device") else True
        nbytes = self.core.workspace_bytes(cuda, groups)
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.name)

    def capsule(self, t):
        return None if t is None else self.to_dlpack(t)

    def stream(self):
        return self.torch.cuda.current_stream().cuda_stream if self.name == "cuda" else 0

    def host(self, t):
        if self.name == "cuda":
            self.torch.cuda.synchronize()  # an asynchronous fault surfaces at this call, not a later one
        return t.cpu().double().numpy()


def run_call(dev, call, case, x, prefill):
    """Runs one call; returns (result, expected float64, mask of entries that must be
    exactly equal to `exact_value`, exact_value array)."""
    c = dev.capsule
    g, off = case.g, case.group_offset
    index_dtype = np.int64 if case.m % 2 else np.int32  # both index types the setup kernel reads
    sizes_np = x["group_sizes"]
    sizes = dev.index(sizes_np, index_dtype)
    offset = None if off is None else dev.index(off, np.int32)
    lhs_r, dout_r = round_to(x["lhs"], call.dtype), round_to(x["dout"], call.dtype)
    if call.kind == "forward":
        rhs = np.ascontiguousarray(x["rhs"].transpose(0, 2, 1)) if call.transpose else x["rhs"]
        bias = dev.tensor(x["bias"], call.dtype) if call.bias else None
        lhs_t = dev.tensor(x["lhs"], call.dtype, offset=1 if call.misaligned else 0)
        out = dev.output((case.m, case.n), call.out_dtype, prefill)
        dev.core.grouped_matmul(c(lhs_t), c(dev.tensor(rhs, call.dtype)), c(sizes), group_offset=c(offset),
                                bias=c(bias), out=c(out), workspace=c(dev.workspace(g)), transpose_rhs=call.transpose,
                                stream=dev.stream())
        want = reference.grouped_matmul(lhs_r, round_to(rhs, call.dtype), sizes_np,
                                        bias=round_to(x["bias"], call.dtype) if call.bias else None,
                                        transpose_rhs=call.transpose, group_offset=case.offset)
        zero_rows = reference.padding_rows(sizes_np, case.m, g, case.offset)
        return dev.host(out), want, np.broadcast_to(zero_rows[:, None], want.shape), np.zeros(want.shape)
    if call.kind == "wgrad":
        lhs_t, grad_t = dev.tensor(x["lhs"], call.dtype), dev.tensor(x["dout"], call.dtype)
        acc = round_to(x["acc"], "float32") if call.accumulate else None
        shape = (g, case.k, case.n)
        out = dev.tensor(acc, "float32") if call.accumulate else dev.output(shape, call.out_dtype, prefill)
        dev.core.grouped_matmul_wgrad(c(lhs_t), c(grad_t), c(sizes), group_offset=c(offset),
                                      accumulate_into=c(out) if call.accumulate else None, out=c(out),
                                      workspace=c(dev.workspace(g)), accumulate=call.accumulate, stream=dev.stream())
        want = reference.grouped_matmul_wgrad(lhs_r, dout_r, sizes_np, g, case.offset, accumulate_into=acc)
        untouched = np.zeros(want.shape, bool)
        untouched[reference.empty_groups(sizes_np, case.m, g, case.offset)] = True
        return dev.host(out), want, untouched, acc if call.accumulate else np.zeros(want.shape)
    if call.kind == "backward":
        return run_backward(dev, call, case, x, prefill, sizes, offset)
    grad_t = dev.tensor(x["dout"], call.dtype)
    out = dev.output((g, case.n), call.out_dtype, prefill)
    dev.core.grouped_bias_grad(c(grad_t), c(sizes), group_offset=c(offset), out=c(out), workspace=c(dev.workspace(g)),
                               stream=dev.stream())
    want = reference.grouped_bias_grad(dout_r, sizes_np, g, case.offset)
    empty = np.zeros(want.shape, bool)
    empty[reference.empty_groups(sizes_np, case.m, g, case.offset)] = True
    return dev.host(out), want, empty, np.zeros(want.shape)


def run_backward(dev, call, case, x, prefill, sizes, offset):
    """grouped_matmul_backward: dlhs, drhs (accumulated or new) and with bias dbias from one
    call, checked as run_call's results, the three flattened one after the other."""
    c, g, sizes_np = dev.capsule, case.g, x["group_sizes"]
    swap = (lambda a: np.ascontiguousarray(a.transpose(0, 2, 1))) if call.transpose else (lambda a: a)
    rhs, lhs_r, dout_r = swap(x["rhs"]), round_to(x["lhs"], call.dtype), round_to(x["dout"], call.dtype)
    acc = swap(round_to(x["acc"], "float32")) if call.accumulate else None
    dlhs = dev.output((case.m, case.k), call.dtype, prefill)
    drhs = dev.tensor(acc, "float32") if call.accumulate else dev.output(rhs.shape, call.out_dtype, prefill)
    dbias = dev.output((g, case.n), call.out_dtype, prefill) if call.bias else None
    dev.core.grouped_matmul_backward(c(dev.tensor(x["lhs"], call.dtype)), c(dev.tensor(rhs, call.dtype)),
                                     c(dev.tensor(x["dout"], call.dtype)), c(sizes), group_offset=c(offset),
                                     dlhs=c(dlhs), drhs=c(drhs), dbias=c(dbias), workspace=c(dev.workspace(g)),
                                     transpose_rhs=call.transpose, accumulate=call.accumulate, stream=dev.stream())
    want_dlhs = reference.grouped_matmul(dout_r, round_to(rhs, call.dtype), sizes_np,
                                         transpose_rhs=not call.transpose, group_offset=case.offset)
    want_drhs = swap(reference.grouped_matmul_wgrad(lhs_r, dout_r, sizes_np, g, case.offset,
                                                    accumulate_into=None if acc is None else swap(acc)))
    padding = np.broadcast_to(reference.padding_rows(sizes_np, case.m, g, case.offset)[:, None], want_dlhs.shape)
    empty = np.zeros(want_drhs.shape, bool)
    empty[reference.empty_groups(sizes_np, case.m, g, case.offset)] = True
    parts = [(dev.host(dlhs), want_dlhs, padding, np.zeros(want_dlhs.shape)),
             (dev.host(drhs), want_drhs, empty, acc if call.accumulate else np.zeros(want_drhs.shape))]
    if call.bias:
        want_dbias = reference.grouped_bias_grad(dout_r, sizes_np, g, case.offset)
        bias_empty = np.zeros(want_dbias.shape, bool)
        bias_empty[reference.empty_groups(sizes_np, case.m, g, case.offset)] = True
        parts.append((dev.host(dbias), want_dbias, bias_empty, np.zeros(want_dbias.shape)))
    return tuple(np.concatenate([np.ravel(p[i]) for p in parts]) for i in range(4))


def mismatch(call, got, want, exact, exact_value):
    """Why `got` is wrong, or None."""
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    if exact.any() and not np.array_equal(got[exact], exact_value[exact]):
        return "entries that must stay exact (padding rows, empty groups, untouched accumulators) changed"
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    error = float(np.abs(got - want).max(initial=0.0)) if got.size else 0.0
    if not np.isfinite(error) or error > TOLERANCE[call.dtype] * scale:
        return f"max error {error:.3g} > {TOLERANCE[call.dtype]:g} x scale {scale:.3g}"
    return None


def has_busy_group(case):
    """Whether some local group of the case owns rows (else no GEMM has work)."""
    return any(e > b for b, e in reference.local_group_rows(case.group_sizes, case.m, case.g, case.offset))


def _error_text(exc):
    """A call's exception as one line."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _record_failure(failures, label, problem):
    """Adds and prints a failed call; True when its CUDA error ends the run (a sticky error
    leaves the context unusable, so every later call would fail too)."""
    failures.append(f"{label}: {problem}")
    print(f"FAIL {label}: {problem}", flush=True)
    if any(word in problem for word in STICKY):
        print("RESULT: FAIL a CUDA error ended the run: " + failures[-1])
        return True
    return False


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import torch
    except ImportError as exc:
        print(f"no CUDA GPU to test: torch is not importable ({exc})")
        print("RESULT: SKIP torch is not installed")
        return NO_GPU_EXIT
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA GPU: torch {torch.__version__} sees no CUDA device; this driver needs one")
        print("RESULT: SKIP no CUDA GPU")
        return NO_GPU_EXIT
    import groupgemm
    from groupgemm import _core

    if args.device == "cuda" and not groupgemm.cuda_compiled():
        print("RESULT: FAIL groupgemm was built without its CUDA backend")
        return 1
    dev = Device(torch, _core, args.device)
    chosen = args.cases is not None or args.expert_cases is not None
    names = (args.cases or []) if chosen else (QUICK_CASES if args.quick else list(ALL_CASES))
    expert_names = ((args.expert_cases or []) if chosen else
                    (expert.QUICK_EXPERT_CASES if args.quick else list(expert.ALL_EXPERT_CASES)))
    families = families_on(torch.cuda.get_device_capability()) if args.device == "cuda" else FAMILIES[:1]
    if args.part != "all":  # one family's GEMMs, or the expert-layer and FP8 kernels without GEMMs
        families = [f for f in families if f == args.part]
        names = names if families else []
        expert_names = expert_names if args.part == "layer" else []
    layer = args.part in ("all", "layer")
    reached, failures, count = set(), [], 0
    for family in families:
        set_kernel_family(family)
        for name in names:
            case = ALL_CASES[name]
            x = inputs(case)
            busy = has_busy_group(case)
            for dtype in DTYPES:
                for call in calls_for(dtype):
                    if call.misaligned and case.m * case.k == 0:
                        continue
                    count += 1
                    label = f"{family}/{case.name}/{call.name}"
                    try:
                        problem = mismatch(call, *run_call(dev, call, case, x, args.prefill))
                    except (RuntimeError, ValueError, TypeError) as exc:
                        problem = _error_text(exc)
                    if problem:
                        if _record_failure(failures, label, problem):
                            return 1
                    else:
                        reached |= kernels_reached(call, case.m, case.k, case.n, case.g, busy, family)
    set_kernel_family(DEFAULT_KERNEL)
    cpu = Device(torch, _core, "cpu")
    compared = bitwise = 0
    for name in expert_names:
        case = expert.ALL_EXPERT_CASES[name]
        x = expert.expert_inputs(case)
        row_map = expert.row_map_of(cpu, case, x)
        for call, kernels in expert.planned_calls(case):
            count += 1
            label = f"{case.name}/{call.name}"
            try:
                results = expert.run_expert_call(dev, cpu, call, case, x, row_map, args.prefill)
                problem = "; ".join(filter(None, map(expert.result_mismatch, results)))
            except (RuntimeError, ValueError, TypeError) as exc:
                results, problem = [], _error_text(exc)
            if problem:
                if _record_failure(failures, label, problem):
                    return 1
            else:
                reached |= kernels
                compared += len(results)
                bitwise += sum(map(expert.bitwise_equal, results))
    if expert_names:
        print(f"expert layer: {len(expert_names)} routing cases; {bitwise} of the {compared} results of passing "
              f"calls equal the CPU backend's bit for bit, the others are within the tolerances")
    mlp_names = [] if chosen or not layer else (mlp.QUICK_MLP_CASES if args.quick else list(mlp.ALL_MLP_CASES))
    hopper = args.device == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    mlp_families = mlp_families_on(hopper)
    # The fused expert MLP: forward and backward per call; under "sm90" only the cases whose
    # calls reach the sm_90a gathered GEMM (the rest run what the default pass ran).
    for family, name in itertools.product(mlp_families, mlp_names):
        case = mlp.ALL_MLP_CASES[name]
        planned = mlp.planned_mlp_calls(case, family)
        if family != DEFAULT_KERNEL and not any(k[0] == GATHERED_SM90 for _, ks in planned for k in ks
                                           if isinstance(k, tuple)):
            continue
        set_kernel_family(family)
        for call, kernels in planned:
            count += 1
            label = f"{case.name}/{call.name}" + ("" if family == DEFAULT_KERNEL else f" under {family}")
            try:
                problem = "; ".join(p for _, p in mlp.run_mlp_call(dev, cpu, case, call, mlp.mlp_inputs(case, call),
                                                                    args.prefill) if p)
            except (RuntimeError, ValueError, TypeError) as exc:
                problem = _error_text(exc)
            if problem:
                if _record_failure(failures, label, problem):
                    return 1
            else:
                reached |= kernels
    set_kernel_family(DEFAULT_KERNEL)
    if mlp_names:
        print(f"fused expert MLP: {len(mlp_names)} cases, a forward and a backward per call, under "
              f"{' and '.join(mlp_families)}")
    fp8_names = [] if chosen or not layer else (fp8.QUICK_FP8_CASES if args.quick else list(fp8.ALL_FP8_CASES))
    fp8_count, fp8_failures = fp8.run(torch, fp8_names, hopper, args.device)
    count += fp8_count
    for failure in fp8_failures:
        label, problem = failure.split(": ", 1)
        if _record_failure(failures, label, problem):
            return 1
    if fp8_names:
        print(f"FP8: {fp8_count} calls over {len(fp8_names)} cases" +
              (" (quantization, and the sm_90a FP8 GEMMs)" if hopper else " (quantization; the GEMMs need Hopper)"))
    # On the CPU backend no kernel runs: the rehearsal checks the calls and the values only.
    required = set().union(*map(required_kernels, families)) | (required_expert_kernels() if layer else set())
    required |= required_expert_mlp_kernels(mlp_families) if mlp_names else set()
    missing = sorted(map(describe, required - reached)) if args.device == "cuda" else []
    print(f"{count} calls over {len(names)} GEMM cases ({' and '.join(families)} kernels) and "
          f"{len(expert_names)} expert-layer cases on {args.device}, "
          f"prefill {args.prefill}; "
          f"{len(required & reached)} of the {len(required)} required kernels and instantiations reached")
    for kernel in missing:
        print(f"not reached: {kernel}")
    if failures or missing:
        print(f"RESULT: FAIL {len(failures)} of {count} calls wrong, {len(missing)} kernels not reached"
              + (f"; first: {failures[0]}" if failures else ""))
        return 1
    if args.device == "cpu":
        print(f"RESULT: PASS {count} calls match the float64 reference or the CPU backend on the CPU backend "
              "(no CUDA kernel ran)")
    else:
        print(f"RESULT: PASS {count} calls match the float64 reference or the CPU backend; all {len(required)} "
              "kernels and instantiations reached")
    return 0


if __name__ == "__main__":
    sys.exit(main())
