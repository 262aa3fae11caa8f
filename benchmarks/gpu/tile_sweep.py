"""Each GEMM of a training step (forward, dgrad, weight gradient) at the GPU kit's benchmark
cells, on each kernel Hopper has: the CUTLASS 2.x kernels and each tile of the Hopper kernel
table, held by GROUPGEMM_CUDA_KERNEL. bfloat16, CUDA-event medians; before timing, each
kernel's forward is checked against the 2.x kernels' (a wrong kernel is reported, and its
times are not written).

The GPU kit's decision reads what it writes (--out, a CSV: one row per cell, GEMM and
kernel, with the GEMM's class in the kernel table) and rewrites the table's choices from
it: benchmarks/kernel_table.py. Prints "RESULT: PASS ..." last; exit status 3 without a
Hopper GPU.
"""

import argparse
import csv
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import kernel_table  # noqa: E402
from contenders import kernel_family  # noqa: E402
from profile_shape import NO_GPU_EXIT, OPS, gemm_calls, operands, time_call  # noqa: E402
from routing import group_sizes  # noqa: E402
from steps import BENCH_CELLS, BENCH_ROUTINGS  # noqa: E402

REPEATS = 10
COLUMNS = ("cell", "experts", "tokens", "hidden", "ffn", "routing", "gemm", "smaller_side", "kernel", "ms", "tflops")
TOLERANCE = 2e-2  # bfloat16 outputs of two kernels, relative to the largest value


def smaller_side(gemm, experts, tokens, hidden, ffn):
    """A GEMM's class in the kernel table: the smaller of its rows per group and its output
    columns (core_cuda/src/kernel_choice.h's smaller_side, restated for the GEMMs of this
    sweep): forward [M/G, N], dgrad [M/G, K], weight gradient [K, N] per group."""
    rows_per_group = tokens // experts
    return {"forward": min(rows_per_group, ffn), "dgrad": min(rows_per_group, hidden),
            "wgrad": min(hidden, ffn)}[gemm]


def cell_name(experts, tokens, hidden, ffn, routing):
    return f"G={experts} {tokens}x{hidden}x{ffn} {routing}"


def read_timings(path):
    """The CSV as kernel_table.Timing rows, one per GEMM of a cell on a kernel."""
    with open(path, newline="") as f:
        return [kernel_table.Timing(f"{r['cell']} {r['gemm']}", int(r["smaller_side"]), r["kernel"],
                                    float(r["ms"]) / 1e3) for r in csv.DictReader(f)]


def sweep(torch, kernels, cells, routings, repeats):
    """(rows, problems): one row per cell, routing, GEMM and kernel."""
    rows, problems = [], []
    for experts, tokens, hidden, ffn in cells:
        shape = {"experts": experts, "tokens": tokens, "hidden": hidden, "ffn": ffn}
        for routing in routings:
            name = cell_name(experts, tokens, hidden, ffn, routing)
            calls = gemm_calls(torch, operands(torch, shape, group_sizes(routing, experts, tokens)), experts)
            with kernel_family(kernel_table.SM80):
                reference = calls["forward"]().float()
            scale = float(reference.abs().max()) or 1.0
            for kernel in kernels:
                with kernel_family(kernel):
                    error = float((calls["forward"]().float() - reference).abs().max())
                    if not error <= TOLERANCE * scale:
                        problems.append(f"{kernel} at {name}: forward differs from the 2.x kernels' by {error:.3g}")
                        continue
                    for gemm in OPS:
                        calls[gemm]()  # warm-up
                        seconds = time_call(torch, calls[gemm], repeats)
                        flops = 2.0 * tokens * hidden * ffn
                        rows.append({"cell": name, "experts": experts, "tokens": tokens, "hidden": hidden,
                                     "ffn": ffn, "routing": routing, "gemm": gemm,
                                     "smaller_side": smaller_side(gemm, experts, tokens, hidden, ffn),
                                     "kernel": kernel, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12})
            del calls
    return rows, problems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the CSV to write")
    p.add_argument("--repeats", type=int, default=REPEATS)
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("RESULT: SKIP needs a compute capability 9.0 GPU")
        return NO_GPU_EXIT
    kernels = (kernel_table.SM80, *kernel_table.read().tile_names)
    rows, problems = sweep(torch, kernels, BENCH_CELLS, BENCH_ROUTINGS, args.repeats)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    for r in rows:
        print(f"{r['cell']:38} {r['gemm']:7} {r['kernel']:14} {r['ms']:8.3f} ms {r['tflops']:6.0f} TFLOP/s")
    if problems:
        print("RESULT: FAIL " + "; ".join(problems))
        return 1
    print(f"RESULT: PASS {len(rows)} GEMMs timed on {len(kernels)} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
