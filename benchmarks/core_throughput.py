"""CPU forward throughput of the core vs one dense GEMM through the same library.

The dense GEMM is the core itself with a single group (one oneDNN matmul over all M
rows), so the ratio isolates what grouping costs. Grouping also means reading G weight
matrices instead of one, so the script measures the machine's memory read bandwidth in
the same rounds and prints the ceiling it puts on the ratio: the dense time over the
time it takes just to read the G weights. Run: python benchmarks/core_throughput.py
"""

import argparse

import torch
from timing import interleaved_medians

import groupgemm._core as core


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
    # Far beyond what the caches hold, so reading it streams from memory.
    stream = torch.ones(256 << 20 >> 2)
    print(f"M={m} K={k} N={n}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'dtype':>9} {'weight':>7} {'G':>4} {'grouped GFLOP/s':>16} {'dense GFLOP/s':>14} {'ratio':>6} "
          f"{'weights read GB/s':>18} {'memory GB/s':>12} {'ratio ceiling':>14}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        lhs = torch.randn(m, k).to(dtype)
        out = torch.empty(m, n, dtype=dtype)
        # [G, K, N], and [G, N, K] (transpose_rhs: the nn.Linear layout GroupedLinear uses).
        for transpose in (False, True):
            calls = {"memory": stream.sum}
            for g in [1] + args.groups:  # one group of all M rows is the dense GEMM
                sizes = torch.full((g,), m // g, dtype=torch.int32)
                sizes[-1] += m - int(sizes.sum())
                rhs = torch.randn(g, n, k) if transpose else torch.randn(g, k, n)
                calls[g] = (lambda rhs=rhs.to(dtype), sizes=sizes:
                            core.grouped_matmul(lhs, rhs, sizes, out=out, transpose_rhs=transpose))
            # Round-robin, so a slow-down of the machine hits the dense and grouped calls alike.
            times = interleaved_medians(calls, args.repeats)
            dense = times[1][0]
            bandwidth = stream.numel() * stream.element_size() / times["memory"][0]
            for g in args.groups:
                grouped = times[g][0]
                weight_bytes = g * k * n * lhs.element_size()
                print(f"{dtype_name:>9} {'[N,K]' if transpose else '[K,N]':>7} {g:>4} "
                      f"{flops / grouped / 1e9:>16.1f} {flops / dense / 1e9:>14.1f} {dense / grouped:>6.2f} "
                      f"{weight_bytes / grouped / 1e9:>18.1f} {bandwidth / 1e9:>12.1f} "
                      f"{dense / (weight_bytes / bandwidth):>14.2f}")

if __name__ == "__main__":
    main()
