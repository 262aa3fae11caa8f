"""torch CUDA graphs around groupgemm, replayed with changing group sizes.

Group sizes live in a device tensor the graph reads at replay, so one capture must serve
every routing, all-empty included. Three checks, in this order, in a fresh process:
  1. cold: the process's first groupgemm call is made inside the capture (a forward with
     bias), so whatever the core sets up on first use must be legal while capturing;
  2. GroupedLinear forward + backward, captured after a warm-up as torch recommends;
  3. the weight gradient accumulated into a float32 buffer (Megatron's main_grad).
Every replay is compared with an eager call (same kernels: same bits), with the CPU
backend (within rounding), and for exact zeros in padding rows and empty experts.
Exit status: 0 all good, 1 a mismatch, 3 no CUDA GPU (or no torch).
"""

import argparse
import os
import sys

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests")
sys.path[:0] = [os.path.join(TESTS, "helpers"), TESTS]  # the tests' float64 reference
from reference import empty_groups, padding_rows  # noqa: E402

NO_GPU_EXIT = 3
M, K, N, G = 96, 64, 32, 4
# Sizes the graph is replayed with: balanced, one expert, none, uneven, more rows than M,
# a negative size (counts as 0).
SIZES = ([24, 24, 24, 24], [96, 0, 0, 0], [0, 0, 0, 0], [10, 0, 50, 7], [0, 100, 0, 0], [-5, 40, 0, 50])
TOLERANCE = 2e-2  # bfloat16, relative to the largest reference value


def rows(mask):
    """Row indices of a boolean NumPy mask, as a list torch can index with."""
    return [int(r) for r in mask.nonzero()[0]]


class Checker:
    def __init__(self, torch):
        self.torch, self.failures = torch, []

    def close(self, what, got, want):
        got, want = got.detach().float().cpu(), want.detach().float().cpu()
        scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
        error = float((got - want).abs().max()) if got.numel() else 0.0
        if not error <= TOLERANCE * scale:
            self.fail(f"{what}: max error {error:.3g} against the CPU backend (scale {scale:.3g})")

    def same(self, what, got, want):
        if not self.torch.equal(got, want):
            self.fail(f"{what}: replay differs from the eager call")

    def zero(self, what, *tensors):
        # Tensors of different shapes (out [M, N] and dx [M, K]) are checked one by one.
        if any(t.numel() and bool((t != 0).any()) for t in tensors):
            self.fail(f"{what}: not exactly zero")

    def fail(self, message):
        self.failures.append(message)
        print(f"FAIL {message}", flush=True)


def capture(torch, step, warm_up):
    """A CUDA graph of step(), returning its static outputs."""
    if warm_up:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static


def cold_forward(torch, gt, check):
    """The first groupgemm call of the process happens while capturing."""
    gen = torch.Generator().manual_seed(1)
    x_cpu = torch.randn(M, K, generator=gen).bfloat16()
    w_cpu = torch.randn(G, K, N, generator=gen).bfloat16()
    b_cpu = torch.randn(G, N, generator=gen).bfloat16()
    x, w, b = x_cpu.cuda(), w_cpu.cuda(), b_cpu.cuda()
    sizes = torch.tensor(SIZES[0], dtype=torch.int32, device="cuda")
    graph, out = capture(torch, lambda: gt.grouped_mm(x, w, sizes, b), warm_up=False)
    for new in SIZES:
        sizes.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        check.same(f"cold forward {new}", out, gt.grouped_mm(x, w, sizes, b))
        check.close(f"cold forward {new}", out, gt.grouped_mm(x_cpu, w_cpu, torch.tensor(new), b_cpu))
        check.zero(f"cold forward {new} padding rows", out[rows(padding_rows(new, M, G))])


def grouped_linear(torch, gt, check):
    torch.manual_seed(0)
    layer = gt.GroupedLinear(G, K, N, device="cuda", dtype=torch.bfloat16)
    reference = gt.GroupedLinear(G, K, N, dtype=torch.bfloat16)
    reference.load_state_dict({k: v.cpu() for k, v in layer.state_dict().items()})
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    sizes = torch.tensor(SIZES[0], dtype=torch.int32, device="cuda")
    params = (x, layer.weight, layer.bias)

    def step():
        y = layer(x, sizes)
        return (y, *torch.autograd.grad(y, params, dy))

    graph, static = capture(torch, step, warm_up=True)
    names = ("out", "dx", "dweight", "dbias")
    for new in SIZES:
        sizes.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for name, replayed, eager in zip(names, static, step()):
            check.same(f"GroupedLinear {new} {name}", replayed, eager)
        x_cpu = x.detach().cpu().requires_grad_()
        y_cpu = reference(x_cpu, torch.tensor(new))
        want = (y_cpu, *torch.autograd.grad(y_cpu, (x_cpu, reference.weight, reference.bias), dy.cpu()))
        for name, replayed, expected in zip(names, static, want):
            check.close(f"GroupedLinear {new} {name}", replayed, expected)
        pad, empty = rows(padding_rows(new, M, G)), empty_groups(new, M, G)
        check.zero(f"GroupedLinear {new} padding rows of out and dx", static[0][pad], static[1][pad])
        check.zero(f"GroupedLinear {new} empty experts' dweight and dbias",
                   static[2][empty], static[3][empty])


def accumulated_wgrad(torch, gt, check):
    gen = torch.Generator().manual_seed(2)
    x_cpu = torch.randn(M, K, generator=gen).bfloat16()
    dy_cpu = torch.randn(M, N, generator=gen).bfloat16()
    x, dy = x_cpu.cuda(), dy_cpu.cuda()
    main_grad = torch.randn(G, K, N, generator=gen).cuda()
    sizes = torch.tensor(SIZES[0], dtype=torch.int32, device="cuda")
    graph, _ = capture(torch, lambda: gt.grouped_mm_wgrad(x, dy, sizes, G, accumulate_into=main_grad), warm_up=True)
    for new in SIZES:
        sizes.copy_(torch.tensor(new, dtype=torch.int32))
        before = main_grad.clone()
        graph.replay()
        torch.cuda.synchronize()
        want = gt.grouped_mm_wgrad(x_cpu, dy_cpu, torch.tensor(new), G, accumulate_into=before.cpu())
        check.close(f"accumulated wgrad {new}", main_grad, want)
        for g in empty_groups(new, M, G):
            if not torch.equal(main_grad[g], before[g]):
                check.fail(f"accumulated wgrad {new}: empty expert {g} changed")


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(
        sys.argv[1:] if argv is None else argv)
    try:
        import torch
    except ImportError as exc:
        print(f"no CUDA GPU to test: torch is not importable ({exc})")
        print("RESULT: SKIP torch is not installed")
        return NO_GPU_EXIT
    if not torch.cuda.is_available():
        print(f"no CUDA GPU: torch {torch.__version__} sees no CUDA device; CUDA graphs need one")
        print("RESULT: SKIP no CUDA GPU")
        return NO_GPU_EXIT
    import groupgemm.torch as gt

    check = Checker(torch)
    for scenario in (cold_forward, grouped_linear, accumulated_wgrad):
        try:
            scenario(torch, gt, check)
            print(f"{scenario.__name__}: {len(SIZES)} replays checked", flush=True)
        except Exception as exc:  # a failed capture is a result; the next scenario still runs
            check.fail(f"{scenario.__name__}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    if check.failures:
        print(f"RESULT: FAIL {len(check.failures)} problems; first: {check.failures[0]}")
        return 1
    print(f"RESULT: PASS cold capture, GroupedLinear fwd+bwd and accumulated wgrad replayed with {len(SIZES)} "
          "routings, all-empty included")
    return 0


if __name__ == "__main__":
    sys.exit(main())
