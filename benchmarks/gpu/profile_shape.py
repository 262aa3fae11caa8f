"""One MoE shape under Nsight Compute: bfloat16, G = 8 experts of 2048 rows (16384 tokens
after dispatch), K = 4096 -> N = 14336, uniform routing.

For each of the three GEMMs of a training step (forward, dgrad with the transposed
weight, weight gradient) it times groupgemm on each kernel family the GPU has (the
CUTLASS 2.x kernels everywhere, each tile of the sm_90a 3.x ones on Hopper),
`torch._grouped_mm` on the same groups where torch has it for this GPU, and dense
`torch.mm` of the same FLOPs, with CUDA events (median of REPEATS after a warm-up), and
reports TFLOP/s and the ratios to dense and to `torch._grouped_mm`. Two ways to run it:

  ncu --profile-from-start off ... python profile_shape.py --under-ncu
      runs each contender once inside the profiler's range, each preceded by a marker
      kernel (torch's spin kernel) so the report can tell which kernels are whose;
  python profile_shape.py --ncu-csv ncu.csv --out profile.md
      times the contenders and writes the report, with each kernel's time and
      speed-of-light figures from the ncu CSV when it is there.

Prints "RESULT: PASS ..." last (FAIL when groupgemm's output disagrees with dense per-group
products); exit status 3 without a CUDA GPU. Parsing and the report are plain functions
the CPU tests check.
"""

import argparse
import csv
import io
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from contenders import GROUPED_MM, family_contender, kernel_family  # noqa: E402
from driver_calls import families_on  # noqa: E402

NO_GPU_EXIT = 3
SHAPE = {"experts": 8, "tokens": 16384, "hidden": 4096, "ffn": 14336}
OPS = ("forward", "dgrad", "wgrad")
DENSE = "dense torch.mm"
REPEATS = 20
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel
MARKER_CYCLES = 1000
TOLERANCE = 2e-2  # bfloat16 products, relative to the largest reference value
# Duration units to µs, as ncu spells them: "ns" with --print-units base (ncu 2025.3),
# "nsecond" in older versions. An unknown unit is an error, not a mislabelled duration.
DURATION_UNITS_IN_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
                        "s": 1e6, "second": 1e6}
# ncu metrics the report shows, by their names in the CSV's details page.
NCU_METRICS = {"Duration": "ncu µs", "Compute (SM) Throughput": "SM %", "DRAM Throughput": "DRAM %",
               "Registers Per Thread": "regs", "Achieved Occupancy": "occupancy %"}


def flops(shape=SHAPE):
    """Every GEMM of the step multiplies tokens x hidden x ffn, whatever its layout."""
    return 2.0 * shape["tokens"] * shape["hidden"] * shape["ffn"]


def contenders(families, grouped_mm=False):
    """(op, contender) pairs in the order they run, under ncu and when timed;
    `grouped_mm`: with torch._grouped_mm."""
    names = [family_contender(f) for f in families] + ([GROUPED_MM] if grouped_mm else []) + [DENSE]
    return [(op, name) for op in OPS for name in names]


def has_grouped_mm(torch):
    """torch._grouped_mm runs bfloat16 on compute capability 9.0 GPUs in every torch that has it."""
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability() == (9, 0)


# ---- the ncu CSV --------------------------------------------------------------------------

def _number(text):
    return float(text.replace(",", ""))


def read_ncu_kernels(text):
    """[(kernel name, {metric: value})] in launch order from ncu's `--csv --page details`
    output (lines before the header, such as ncu's own ==PROF== messages, are skipped)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    kernels, index = [], {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if row.get("ID") is None or row.get("Metric Name") is None:
            continue
        if row["ID"] not in index:
            index[row["ID"]] = len(kernels)
            kernels.append((row["Kernel Name"], {}))
        try:
            value = _number(row["Metric Value"])
        except ValueError:
            continue
        if row["Metric Name"] == "Duration":  # in the unit ncu printed: to µs
            if row["Metric Unit"] not in DURATION_UNITS_IN_US:
                raise ValueError(f"ncu printed a kernel duration in an unknown unit, {row['Metric Unit']!r}")
            value *= DURATION_UNITS_IN_US[row["Metric Unit"]]
        kernels[index[row["ID"]]][1][row["Metric Name"]] = value
    return kernels


def kernels_by_contender(kernels, order):
    """{(op, contender): [(kernel name, metrics)]}: the kernels after each marker belong
    to the contender that ran there. None when the markers do not match the order (a
    different run, or a truncated report)."""
    groups, current = [], None
    for name, metrics in kernels:
        if MARKER in name:
            current = []
            groups.append(current)
        elif current is not None:
            current.append((name, metrics))
    if len(groups) != len(order):
        return None
    return dict(zip(order, groups))


def short_kernel_name(name, width=60):
    """Drop template arguments: 'cutlass::Kernel<cutlass::gemm::...>' -> 'cutlass::Kernel<...>'."""
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            if depth == 0:
                out.append("<...>")
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    short = "".join(out).split("(")[0].strip()
    return short if len(short) <= width else short[:width - 3] + "..."


# ---- the report ---------------------------------------------------------------------------

def report(times, ncu, environment, shape=SHAPE):
    """Markdown: one row per (op, contender) with its median ms, TFLOP/s and ratios to
    dense and to torch._grouped_mm (when timed), then each contender's kernels as ncu saw
    them (when `ncu` is not None)."""
    lines = [f"# One MoE shape: bfloat16, G = {shape['experts']}, {shape['tokens']} tokens, "
             f"{shape['hidden']} -> {shape['ffn']}, uniform routing", "", environment, "",
             f"| GEMM | contender | ms (median) | TFLOP/s | vs dense | vs {GROUPED_MM} |", "|---|---|---|---|---|---|"]
    for (op, name), seconds in times.items():
        grouped_mm = times.get((op, GROUPED_MM))
        versus = "" if grouped_mm is None else f"{grouped_mm / seconds:.2f}"
        lines.append(f"| {op} | {name} | {seconds * 1e3:.3f} | {flops(shape) / seconds / 1e12:.0f} | "
                     f"{times[(op, DENSE)] / seconds:.2f} | {versus} |")
    if ncu is None:
        lines += ["", "No Nsight Compute figures (no report, or its markers did not match this run)."]
        return "\n".join(lines) + "\n"
    columns = list(NCU_METRICS.values())
    lines += ["", "Kernels under Nsight Compute (its default clock control: base clocks, so its "
              "durations run longer than the timings above):", "",
              "| GEMM | contender | kernel | " + " | ".join(columns) + " |",
              "|---|---|---|" + "---|" * len(columns)]
    for (op, name), kernels in ncu.items():
        for kernel, metrics in kernels:
            cells = [f"{metrics[m]:.1f}" if m in metrics else "" for m in NCU_METRICS]
            lines.append(f"| {op} | {name} | `{short_kernel_name(kernel)}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---- on the GPU ---------------------------------------------------------------------------

def operands(torch, shape, sizes=None):
    """bfloat16 x [M, K], w [G, K, N], dy [M, N] on the GPU and int32 group sizes (`sizes`,
    or M / G each)."""
    g, m, k, n = shape["experts"], shape["tokens"], shape["hidden"], shape["ffn"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: torch.randn(*s, device="cuda", generator=gen).mul_(0.1).to(torch.bfloat16)  # noqa: E731
    sizes = torch.tensor(sizes if sizes is not None else [m // g] * g, dtype=torch.int32, device="cuda")
    return rand(m, k), rand(g, k, n), rand(m, n), sizes


def gemm_calls(torch, operands, num_groups):
    """{op: fn} of groupgemm's three GEMMs of a training step; each picks its kernel from
    GROUPGEMM_CUDA_KERNEL at the call."""
    import groupgemm.torch as gt
    x, w, dy, sizes = operands
    return {"forward": lambda: gt.grouped_mm(x, w, sizes),
            "dgrad": lambda: gt.grouped_mm(dy, w, sizes, transpose_weight=True),
            "wgrad": lambda: gt.grouped_mm_wgrad(x, dy, sizes, num_groups)}


def time_call(torch, fn, repeats=None):
    """Median seconds of `repeats` calls (REPEATS by default), each between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats or REPEATS):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def _calls(torch, families, grouped_mm, shape):
    """{(op, contender): fn}. groupgemm picks its kernel family from
    GROUPGEMM_CUDA_KERNEL at each call; torch._grouped_mm takes the same groups as
    cumulative ends, and computes the weight gradient as torch's own backward does (its
    contraction split at the ends)."""
    x, w, dy, sizes = arrays = operands(torch, shape)

    def on(family, fn):
        def call():
            with kernel_family(family):
                return fn()
        return call

    grouped = gemm_calls(torch, arrays, shape["experts"])
    ends = torch.cumsum(sizes, 0, dtype=torch.int32)
    torch_grouped = {"forward": lambda: torch._grouped_mm(x, w, offs=ends),
                     "dgrad": lambda: torch._grouped_mm(dy, w.transpose(-2, -1), offs=ends),
                     "wgrad": lambda: torch._grouped_mm(x.t(), dy, offs=ends)}
    dense = {"forward": lambda: torch.mm(x, w[0]), "dgrad": lambda: torch.mm(dy, w[0].t()),
             "wgrad": lambda: torch.mm(x.t(), dy)}
    baselines = {DENSE: dense, GROUPED_MM: torch_grouped}
    family_of = {family_contender(f): f for f in families}
    calls = {}
    for op, name in contenders(families, grouped_mm):
        calls[(op, name)] = baselines[name][op] if name in baselines else on(family_of[name], grouped[op])
    return calls, (x, w, sizes)


def _check_forward(torch, calls, operands, families):
    """groupgemm's forward on each family against per-group dense products."""
    x, w, sizes = operands
    rows = int(sizes[0])
    want = torch.cat([torch.mm(x[i * rows:(i + 1) * rows], w[i]) for i in range(w.shape[0])]).float()
    scale = float(want.abs().max())
    problems = []
    for family in families:
        got = calls[("forward", family_contender(family))]().float()
        error = float((got - want).abs().max())
        if not error <= TOLERANCE * scale:
            problems.append(f"{family} forward: max error {error:.3g} (scale {scale:.3g})")
    return problems


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--under-ncu", action="store_true", help="run each contender once inside the profiler's range")
    p.add_argument("--ncu-csv", help="ncu's --csv --page details output, for the report")
    p.add_argument("--out", help="write the markdown report here")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("RESULT: SKIP torch is not installed")
        return NO_GPU_EXIT
    if not torch.cuda.is_available():
        print("RESULT: SKIP no CUDA GPU")
        return NO_GPU_EXIT
    families = families_on(torch.cuda.get_device_capability())
    grouped_mm = has_grouped_mm(torch)
    calls, operands = _calls(torch, families, grouped_mm, SHAPE)
    order = contenders(families, grouped_mm)
    for fn in calls.values():  # warm-up: first-use setup stays out of the profile and the timings
        fn()
    torch.cuda.synchronize()
    if args.under_ncu:
        torch.cuda.profiler.start()
        for key in order:
            torch.cuda._sleep(MARKER_CYCLES)
            calls[key]()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"RESULT: PASS ran {len(order)} contenders under the profiler")
        return 0
    problems = _check_forward(torch, calls, operands, families)
    times = {key: time_call(torch, calls[key]) for key in order}
    ncu = None
    if args.ncu_csv and os.path.exists(args.ncu_csv):
        with open(args.ncu_csv, errors="replace") as f:
            ncu = kernels_by_contender(read_ncu_kernels(f.read()), order)
    environment = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
                   f"CUDA-event medians of {REPEATS} calls after a warm-up")
    text = report(times, ncu, environment)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    fastest = {op: min(times[(op, family_contender(f))] for f in families) for op in OPS}
    summary = ", ".join(f"{op} {times[(op, DENSE)] / fastest[op]:.2f}x dense" +
                        (f" {times[(op, GROUPED_MM)] / fastest[op]:.2f}x {GROUPED_MM}" if grouped_mm else "")
                        for op in OPS)
    if problems:
        print("RESULT: FAIL " + "; ".join(problems))
        return 1
    print(f"RESULT: PASS {summary}" + ("" if ncu else "; no ncu figures"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
