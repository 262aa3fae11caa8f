"""FP8 benchmark (PyTorch): groupgemm's FP8 grouped GEMMs against its bfloat16 ones and
torch.nn.functional.scaled_grouped_mm, in one interleaved run per shape.

For each expert shape and routing it times, forward and forward+backward (inputs and
weights bfloat16, as in training):
- groupgemm bf16:            GroupedLinear, the 16-bit GEMMs;
- groupgemm fp8 rowwise / blockwise: GroupedLinear(fp8=...), quantization included;
and, forward only on pre-quantized operands (the GEMM alone):
- groupgemm scaled_grouped_mm (rowwise, blockwise);
- torch.nn.functional.scaled_grouped_mm (RowWise x RowWise, its only FP8 recipe), or on
  older torch torch._scaled_grouped_mm, where the GPU runs it (Hopper or Blackwell).
Before timing, every FP8 result is checked: within FP8's quantization error of the
bfloat16 layer (the GEMMs' outputs and gradients), and groupgemm's scaled GEMM against
torch's on the same operands. Prints one markdown table per shape and ends with a
RESULT line (FAIL on a wrong groupgemm result).

    python benchmarks/fp8_bench.py --device cuda
    python benchmarks/fp8_bench.py --device cpu --shapes 4,512,256,256   # a rehearsal
"""

import argparse
import sys

import numpy as np
from routing import ROUTINGS, group_sizes
from timing import interleaved_medians

from groupgemm import _contract as contract

# Experts, tokens (rows after top-k dispatch), hidden (K), FFN width (N); multiples of 128.
DEFAULT_SHAPES = ("8,16384,4096,2048", "32,16384,7168,2048", "128,16384,2048,1408")
FP8_RECIPES = contract.FP8_RECIPES
# FP8 (e4m3) against the bfloat16 layer: relative Frobenius error of outputs and gradients.
FP8_ERROR = 0.08
# groupgemm's scaled GEMM against torch's on the same float8 operands: both accumulate in
# float32 (their summation orders differ) and round to bfloat16.
KERNEL_AGREEMENT = 1e-2


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="G,M,K,N per shape")
    p.add_argument("--routing", nargs="+", default=["uniform", "skewed-some-empty"], choices=ROUTINGS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget", type=float, default=2.0, help="seconds of samples per contender, at most")
    return p.parse_args(argv)


def relative_error(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


def _torch_rowwise(torch, F):
    """torch's rowwise FP8 grouped GEMM, (mat_a, mat_b, scale_a, scale_b, offs) -> bfloat16:
    torch.nn.functional.scaled_grouped_mm (torch 2.10 and later), else torch._scaled_grouped_mm;
    None when this torch has neither."""
    if hasattr(F, "scaled_grouped_mm") and hasattr(F, "ScalingType"):
        rowwise = F.ScalingType.RowWise
        return lambda a, b, sa, sb, offs: F.scaled_grouped_mm(a, b, sa, rowwise, sb, rowwise, offs=offs)
    if hasattr(torch, "_scaled_grouped_mm"):
        return lambda a, b, sa, sb, offs: torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    return None


def run_shape(torch, gt, device, g, m, k, n, routing, args):
    """(table rows, problems) of one shape and routing."""
    import torch.nn.functional as F

    gen = torch.Generator(device="cpu").manual_seed(0)
    sizes = torch.tensor(group_sizes(routing, g, m), device=device)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    dout = torch.randn(m, n, generator=gen).to(device=device, dtype=torch.bfloat16)
    layers = {}
    for recipe in (None, *FP8_RECIPES):
        torch.manual_seed(0)  # the same weights in every layer
        layers[recipe] = gt.GroupedLinear(g, k, n, bias=False, device=device, dtype=torch.bfloat16, fp8=recipe)
    wait = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def forward(layer):
        def run():
            with torch.no_grad():
                layer(x, sizes)
            wait()
        return run

    def forward_backward(layer):
        def run():
            xg = x.detach().requires_grad_()
            y = layer(xg, sizes)
            grads = torch.autograd.grad(y, (xg, layer.weight), dout)
            wait()
            return y.detach(), *grads
        return run

    problems = []
    reference = forward_backward(layers[None])()
    for recipe in FP8_RECIPES:
        for what, got, want in zip(("out", "dx", "dw"), forward_backward(layers[recipe])(), reference):
            error = relative_error(got, want)
            if not np.isfinite(error) or error > FP8_ERROR:
                problems.append(f"fp8 {recipe} {what}: relative error {error:.3g} against bfloat16 > {FP8_ERROR}")

    # The GEMMs alone, on operands quantized once.
    w = layers[None].weight.detach()  # [G, N, K]
    gemms = {}
    for recipe in FP8_RECIPES:
        (qx, sx), (qw, sw) = gt.quantize_fp8(x, recipe), gt.quantize_fp8(w, recipe)
        pair = contract.torch_fp8_scalings("2d-3d", recipe)
        gemms[f"groupgemm scaled_grouped_mm {recipe}"] = (
            lambda qx=qx, qw=qw, sx=sx, sw=sw, pair=pair: gt.scaled_grouped_mm(
                qx, qw.transpose(-2, -1), sx, pair[0], sw, pair[1], group_sizes=sizes))
        if recipe == "rowwise" and device == "cuda" and _torch_rowwise(torch, F) is not None:
            offs = torch.cumsum(sizes, 0, dtype=torch.int32)
            torch_gemm = lambda qx=qx, qw=qw, sx=sx, sw=sw: _torch_rowwise(torch, F)(  # noqa: E731
                qx, qw.transpose(-2, -1), sx, sw, offs)
            try:
                theirs, ours = torch_gemm(), gemms["groupgemm scaled_grouped_mm rowwise"]()
                owned = int(sizes.sum())  # torch leaves the rows past offs[-1] unwritten
                error = relative_error(ours[:owned], theirs[:owned])
                if error > KERNEL_AGREEMENT:
                    problems.append(f"scaled_grouped_mm rowwise: {error:.3g} from torch's on the same operands")
                gemms["torch scaled_grouped_mm rowwise"] = torch_gemm
            except RuntimeError as exc:  # a GPU or group sizes torch's kernel refuses
                print(f"torch.nn.functional.scaled_grouped_mm: {str(exc).splitlines()[0]}")

    def timed(fn):
        def run():
            fn()
            wait()
        return run

    fns = {f"{name} forward": forward(layer) for name, layer in
           (("groupgemm bf16", layers[None]), *((f"groupgemm fp8 {r}", layers[r]) for r in FP8_RECIPES))}
    fns.update({f"{name} forward+backward": forward_backward(layer) for name, layer in
                (("groupgemm bf16", layers[None]), *((f"groupgemm fp8 {r}", layers[r]) for r in FP8_RECIPES))})
    fns.update({f"{name} (GEMM only)": timed(fn) for name, fn in gemms.items()})
    medians = interleaved_medians(fns, args.repeats, args.budget)
    flops = 2 * int(sizes.clamp(min=0).sum().clamp(max=m)) * k * n
    rows = []
    base = {kind: medians[f"groupgemm bf16 {kind}"][0] for kind in ("forward", "forward+backward")}
    for name, (seconds, _) in medians.items():
        kind = "forward+backward" if name.endswith("forward+backward") else "forward"
        work = flops * (3 if kind == "forward+backward" else 1)
        rows.append((name, seconds * 1e3, work / seconds / 1e12, base[kind] / seconds))
    return rows, problems


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    import groupgemm.torch as gt

    if args.device == "cuda" and not torch.cuda.is_available():
        print("RESULT: SKIP no CUDA GPU")
        return 0
    problems = []
    for shape in args.shapes:
        g, m, k, n = map(int, shape.split(","))
        for routing in args.routing:
            try:
                rows, found = run_shape(torch, gt, args.device, g, m, k, n, routing, args)
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                problems.append(f"G={g} M={m} K={k} N={n} {routing}: {type(exc).__name__}: {exc}")
                continue
            problems += [f"G={g} M={m} K={k} N={n} {routing}: {p}" for p in found]
            print(f"\nG = {g}, M = {m}, K = {k}, N = {n}, {routing} routing ({args.device}):\n")
            print("| contender | ms | TFLOP/s | speed-up over groupgemm bf16 |\n|---|---|---|---|")
            for name, ms, tflops, speedup in rows:
                print(f"| {name} | {ms:.3g} | {tflops:.3g} | {speedup:.2f}x |")
    if problems:
        print(f"RESULT: FAIL {len(problems)} problems; first: {problems[0]}")
        return 1
    print(f"RESULT: PASS {len(args.shapes) * len(args.routing)} shapes and routings; FP8 results within "
          f"{FP8_ERROR} of bfloat16 (and of torch's scaled_grouped_mm where it ran)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
