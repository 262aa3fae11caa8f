"""CPU forward throughput of the core vs one dense GEMM through the same library.

The dense GEMM is the core itself with a single group (one oneDNN matmul over all M
rows), so the ratio isolates what grouping costs. Run: python benchmarks/core_throughput.py
"""

import argparse

import torch

import groupgemm._core as core
from timing import interleaved_medians


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--m", type=int, default=4096, help="rows (tokens x top-k)")
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    m, k, n = args.m, args.k, args.n
    flops = 2.0 * m * k * n
    print(f"M={m} K={k} N={n}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'dtype':>9} {'weight':>7} {'G':>4} {'grouped GFLOP/s':>16} {'dense GFLOP/s':>14} {'ratio':>6}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        lhs = torch.randn(m, k).to(dtype)
        out = torch.empty(m, n, dtype=dtype)
        # [G, K, N], and [G, N, K] (transpose_rhs: the nn.Linear layout GroupedLinear uses).
        for transpose in (False, True):
            calls = {}
            for g in [1] + args.groups:  # one group of all M rows is the dense GEMM
                sizes = torch.full((g,), m // g, dtype=torch.int32)
                sizes[-1] += m - int(sizes.sum())
                rhs = torch.randn(g, n, k) if transpose else torch.randn(g, k, n)
                calls[g] = (lambda rhs=rhs.to(dtype), sizes=sizes:
                            core.grouped_matmul(lhs, rhs, sizes, out, transpose_rhs=transpose))
            # Round-robin, so a slow-down of the machine hits the dense and grouped calls alike.
            times = interleaved_medians(calls, args.repeats)
            dense = times[1][0]
            for g in args.groups:
                grouped = times[g][0]
                print(f"{dtype_name:>9} {'[N,K]' if transpose else '[K,N]':>7} {g:>4} "
                      f"{flops / grouped / 1e9:>16.1f} {flops / dense / 1e9:>14.1f} {dense / grouped:>6.2f}")

if __name__ == "__main__":
    main()
