"""Grouped-GEMM benchmark: groupgemm against its peers in JAX and PyTorch, in one run.

For every configuration (dtype x experts x tokens x hidden x ffn x routing) and framework
it times forward and forward+backward of groupgemm, the framework's own grouped GEMM
(jax.lax.ragged_dot, torch._grouped_mm), a per-expert loop, and one dense GEMM of the
same total size (the ceiling). Calls are interleaved round-robin so machine noise hits
all of them alike. Before timing, each contender's output and gradients are checked
once against a float32 per-expert reference; a wrong groupgemm result fails the run.
It also measures the call overhead with every expert empty.

Writes bench.csv, bench.json and bench.png to --out and prints markdown tables.
Example: python benchmarks/bench.py --dtype float32 bfloat16 --experts 8 64
"""

import argparse
import importlib
import itertools
import os
import platform
import sys
import textwrap

import overhead
import report
from contenders import GROUPGEMM, SKIPPABLE
from problem import Config, Problem, check
from progress import Progress
from routing import ROUTINGS
from timing import interleaved_medians

FRAMEWORKS = {"jax": "jax_contenders", "torch": "torch_contenders"}
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MEMORY_HELP = textwrap.fill(
    "Peak memory is measured on CUDA only: torch.cuda.max_memory_allocated() above what was "
    "allocated before one forward+backward, and for JAX the device's peak_bytes_in_use when "
    "the call raised it (XLA's peak cannot be reset, so a call below an earlier peak shows n/a). "
    "On CPU it is n/a: torch keeps no CPU allocator statistics, tracemalloc does not see native "
    "allocations and the process's maxrss only ever grows. For JAX, 'XLA temp MB' is what XLA "
    "planned for the temporaries of forward+backward (allocations inside custom calls excluded).",
    width=90)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, epilog=MEMORY_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where to run; on cuda every timed call waits for the device")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64], help="G, experts (groups)")
    p.add_argument("--tokens", type=int, nargs="+", default=[4096], help="M, rows after top-k dispatch")
    p.add_argument("--hidden", type=int, nargs="+", default=[1024], help="K, model width")
    p.add_argument("--ffn", type=int, nargs="+", default=[1024], help="N, expert FFN width")
    p.add_argument("--shapes", nargs="+", metavar="G,M,K,N",
                   help="expert shapes to run instead of the product of --experts, --tokens, --hidden and --ffn "
                        "(real models are points, not a grid)")
    p.add_argument("--routing", nargs="+", default=["uniform", "skewed", "some-empty", "skewed-some-empty"],
                   choices=ROUTINGS,
                   help="rows per expert: equal; Zipf-like; a quarter of experts empty, the rest equal; "
                        "a quarter empty, the rest Dirichlet-skewed; all empty (then there is nothing to "
                        "compute and the times are overhead)")
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=list(FRAMEWORKS))
    p.add_argument("--skip", nargs="+", default=[], choices=SKIPPABLE, metavar="CONTENDER",
                   help=f"contenders to leave out, of: {'; '.join(SKIPPABLE)} (at large shapes ragged_dot's "
                        "G-fold work, or compiling a JAX loop over many experts, takes minutes)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per contender (median)")
    p.add_argument("--budget", type=float, default=15.0,
                   help="seconds of timed calls per contender and mode; slow ones get fewer repeats")
    p.add_argument("--overhead-repeats", type=int, default=overhead.REPEATS,
                   help="calls per median of the empty-call overhead")
    p.add_argument("--out", default=DEFAULT_OUT, help="directory for bench.csv, bench.json, bench.png")
    return p.parse_args(argv)


def shapes(args):
    """(G, M, K, N) of each expert shape the run covers."""
    if args.shapes:
        return [tuple(int(v) for v in shape.split(",")) for shape in args.shapes]
    return list(itertools.product(args.experts, args.tokens, args.hidden, args.ffn))


def configs(args):
    return [Config(dtype, *shape, routing)
            for dtype, shape, routing in itertools.product(args.dtype, shapes(args), args.routing)]


def _error_text(exc):
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line}"


def _prepare(framework, module, problem, args, progress, label):
    """Builds (compiles) every contender and checks its results once. Returns the rows
    and {name: Contender} for those that ran."""
    rows, ready = [], {}
    for name, build in module.contenders(problem, args.device).items():
        if name in args.skip:
            continue
        progress.show(f"{label}: compile and check {name}")
        row = {"framework": framework, "device": args.device, **vars(problem.config), "impl": name}
        rows.append(row)
        try:
            contender = build()
            results = contender.forward_backward()
            contender.forward()
        except Exception as exc:  # an unsupported dtype or device is a result, not a crash
            row["error"] = _error_text(exc)
            continue
        if contender.checked:
            passed, error, worst = check(problem, [module.to_numpy(r) for r in results])
            row["check"] = "ok" if passed else f"FAIL in {worst}"
            row["max_rel_error"] = error
        else:
            row["check"] = "not checked"
        if contender.xla_temp_bytes is not None:
            row["xla_temp_mb"] = contender.xla_temp_bytes / 2**20
        ready[name] = contender
    return rows, ready


def run_framework(framework, problem, args, progress):
    module = importlib.import_module(FRAMEWORKS[framework])
    c = problem.config
    label = f"{framework} {c.dtype} G={c.experts} {c.tokens}x{c.hidden}x{c.ffn} {c.routing}"
    rows, ready = _prepare(framework, module, problem, args, progress, label)
    calls = {}
    for name, contender in ready.items():
        calls[(name, "fwd")] = contender.forward
        calls[(name, "fwd_bwd")] = contender.forward_backward
    # On CPU the contenders share the cores with work a call leaves behind (timing.py);
    # a GPU call's time is the device's.
    medians = interleaved_medians(calls, args.repeats, args.budget, settle=args.device == "cpu",
                                  on_round=lambda i, n: progress.show(f"{label}: timing round {i + 1}/{n}"))
    for row in rows:
        if row["impl"] not in ready:
            continue
        samples = []
        for mode in ("fwd", "fwd_bwd"):
            seconds, count = medians[(row["impl"], mode)]
            row[f"{mode}_ms"] = seconds * 1e3
            samples.append(str(count))
        row["samples"] = "/".join(samples)  # forward / forward+backward
        peak = ready[row["impl"]].peak_bytes()
        row["peak_mb"] = None if peak is None else peak / 2**20
    progress.step(label)
    return report.derive(rows, c)


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine(device):
    info = {"device": device, "cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()}
    for name in ("jax", "torch"):
        if name in sys.modules:
            info[name] = sys.modules[name].__version__
    if device == "cuda" and "torch" in sys.modules:
        info["gpu"] = sys.modules["torch"].cuda.get_device_name()
    return info


def measure_overhead(args, progress):
    rows = []
    for framework in args.frameworks:
        progress.show(f"{framework} overhead, all experts empty")
        try:
            rows += overhead.measure(framework, args.device, args.overhead_repeats)
        except Exception as exc:  # reported in the results like any other failure
            rows.append({"framework": framework, "call": "all", "impl": GROUPGEMM, "median_us": float("nan"),
                         "error": _error_text(exc)})
        progress.step(f"{framework} overhead")
    return rows


def write_outputs(args, argv, todo, rows, overhead_rows):
    os.makedirs(args.out, exist_ok=True)
    report.write_csv(os.path.join(args.out, "bench.csv"), rows)
    info = machine(args.device)
    report.write_json(os.path.join(args.out, "bench.json"), {
        "command": "python benchmarks/bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": info, "results": rows, "overhead": overhead_rows})
    shapes = ", ".join(dict.fromkeys(f"{c.tokens},{c.hidden},{c.ffn}" for c in todo))
    title = f"{args.device}, {info['cpu']}, {info['cores']} cores; M,K,N = {shapes}"
    import chart  # matplotlib only once there is something to draw
    chart.write_chart(os.path.join(args.out, "bench.png"), rows, title)


def print_tables(args, rows, overhead_rows):
    for framework in args.frameworks:
        print(f"\n{framework}, {args.device}; each cell is forward / forward+backward, times are medians\n")
        print(report.markdown_table(rows, framework))
    for framework in args.frameworks:
        print(f"\n{framework}, {args.device}: groupgemm against each contender (forward / forward+backward)\n")
        print(report.summary_table(rows, framework))
    targets = report.targets_table(rows)
    if targets:
        print(f"\n{targets}")
    shape = overhead.SHAPE
    print(f"\nCall overhead: bfloat16, every expert empty (M={shape['tokens']}, K={shape['hidden']}, "
          f"N={shape['ffn']}, G={shape['experts']}), medians of one interleaved run per framework; "
          "target: groupgemm at most 1.0x its peer\n")
    print(report.overhead_table(overhead_rows))
    print(f"\nwrote bench.csv, bench.json, bench.png to {args.out}")


def main(argv=None):
    args = parse_args(argv)
    todo = configs(args)
    progress = Progress(len(todo) * len(args.frameworks) + len(args.frameworks))
    rows = []
    for config in todo:
        progress.show(f"drawing inputs for {config}")
        problem = Problem.draw(config)
        for framework in args.frameworks:
            rows += run_framework(framework, problem, args, progress)
    overhead_rows = measure_overhead(args, progress)
    progress.close()
    write_outputs(args, argv, todo, rows, overhead_rows)
    print_tables(args, rows, overhead_rows)
    wrong = report.failed_checks(rows)
    for r in wrong:
        print(f"{r['impl']} {r['framework']} {r['dtype']} G={r['experts']} {r['routing']}: "
              f"{r.get('error') or r.get('check')}", file=sys.stderr)
    summary = f"{len(todo)} configurations; {report.digest(rows) or 'no groupgemm timings'}"
    print(f"RESULT: FAIL {len(wrong)} groupgemm results failed their check; {summary}" if wrong else
          f"RESULT: PASS {summary}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
