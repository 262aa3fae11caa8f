"""groupgemm.torch vs a per-expert torch.mm loop vs torch._grouped_mm (CPU or CUDA).

Forward and forward+backward (dinput and dweight) in one run.
Run: python benchmarks/torch_vs_peers.py [--dtypes float32 bfloat16] [--groups 8 64]
"""

import argparse

import torch

from groupgemm.torch import grouped_mm
from timing import add_shape_arguments, median_seconds


def per_expert_loop(x, w, sizes_list):
    return torch.cat([a @ b for a, b in zip(torch.split(x, sizes_list), w)])


def main():
    p = argparse.ArgumentParser(description=__doc__)
    add_shape_arguments(p)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    flops = 2.0 * a.m * a.k * a.n
    print(f"M={a.m} K={a.k} N={a.n} on {a.device}, {torch.get_num_threads()} threads, median of {a.repeats} (ms)")
    print(f"{'dtype':>9} {'G':>4} {'impl':>14} {'fwd':>8} {'fwd+bwd':>8} {'fwd GFLOP/s':>12}")
    for dtype_name in a.dtypes:
        dtype = getattr(torch, dtype_name)
        for g in a.groups:
            sizes_list = [a.m // g] * g
            sizes_list[-1] += a.m - sum(sizes_list)
            sizes = torch.tensor(sizes_list, device=a.device)
            offs = torch.cumsum(sizes, 0).to(torch.int32)
            x = torch.randn(a.m, a.k, device=a.device).to(dtype).requires_grad_()
            w = torch.randn(g, a.k, a.n, device=a.device).to(dtype).requires_grad_()
            dy = torch.randn(a.m, a.n, device=a.device).to(dtype)
            impls = {
                "groupgemm": lambda: grouped_mm(x, w, sizes),
                "torch.mm loop": lambda: per_expert_loop(x, w, sizes_list),
                "_grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs),
            }
            def synced(fn):
                def run():
                    fn()
                    if a.device.startswith("cuda"):
                        torch.cuda.synchronize()
                return run

            for name, fn in impls.items():
                def train():
                    x.grad = w.grad = None
                    fn().backward(dy)
                with torch.no_grad():
                    fwd = median_seconds(synced(fn), a.repeats)
                both = median_seconds(synced(train), a.repeats)
                print(f"{dtype_name:>9} {g:>4} {name:>14} {fwd * 1e3:>8.1f} {both * 1e3:>8.1f} {flops / fwd / 1e9:>12.1f}")


if __name__ == "__main__":
    main()
