"""The lease kit: groupgemm's GPU checks and measurements as two commands that fit a
15-minute lease on a machine with an NVIDIA GPU and no network.

    ./dev.sh gpu [check|extra] [--wheels DIR] [--out DIR] [--deadline S] [--dry-run]

It runs under the machine's own python3 (torch, jax with its CUDA plugin, pytest,
pytest-xdist), starts from the carried wheels (./dev.sh gpu-wheels: the redistributable
cp312 groupgemm wheel, oneDNN, OpenBLAS, transformers and what it imports), installs them
into a scratch prefix and builds nothing. `check` (540 s): install, environment, the GPU
tests on every kernel, the sanitizer, capture, the benchmark's core cells, and the kernel
table's decision; `extra` (240 s): the profile under Nsight Compute, the rest of the suite
and transformers' experts implementations against groupgemm. Steps run in that
priority order, each within its own limit under the run's deadline; a step's commands run
side by side where they only check (the tests, the sanitizer, capture) and one after
another where they time the GPU. Every step runs even when an earlier one failed (after a
failed install, those that need it are skipped) and gets a verdict; the summary comes
last and lands, with the log and the results, in --out (at most 8 files).
--dry-run prints the device call: the command line, the folders to carry and their size,
and each step's limit and deadline. Standard library only.
"""

import argparse
import concurrent.futures
import dataclasses
import datetime
import io
import json
import os
import re
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import expert_mlp_report  # noqa: E402
import kernel_table  # noqa: E402
import machine  # noqa: E402
import results_dir  # noqa: E402
import runner  # noqa: E402
import steps  # noqa: E402
import transformers_report  # noqa: E402
import verdicts  # noqa: E402
import wheels  # noqa: E402
from verdicts import FAIL, INCOMPLETE, PASS, SKIP, Verdict  # noqa: E402

REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
DEFAULT_OUT = os.path.join("benchmarks", "results", "gpu")
DEFAULT_SCRATCH = os.path.join("build", "gpu-kit")
TAIL_LINES = 15  # of a failing command's output, echoed to the terminal
COMMAND_LIMIT = 2000  # characters of a device call's command line


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="./dev.sh gpu", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check and measure groupgemm's CUDA backend on this machine's GPU, offline, within a lease.",
        epilog="; ".join(f"{run}: {', '.join(names)}" for run, names in steps.RUNS.items()))
    p.add_argument("run", nargs="?", choices=list(steps.RUNS), default="check",
                   help="check (the first command of a lease) or extra (the second)")
    p.add_argument("--wheels", help=f"the carried wheels, from ./dev.sh gpu-wheels (default {wheels.DEFAULT_DEST})")
    p.add_argument("--out", help=f"folder for the log, the summary and the results, at most 8 files "
                                 f"(default {DEFAULT_OUT})")
    p.add_argument("--scratch", help=f"folder for the prefix and the temporary files (default {DEFAULT_SCRATCH})")
    p.add_argument("--deadline", type=float, metavar="SECONDS",
                   help=f"end the run by this many seconds (default: check {steps.DEADLINE['check']}, "
                        f"extra {steps.DEADLINE['extra']})")
    p.add_argument("--dry-run", action="store_true", help="print the device call and the plan; run nothing")
    args = p.parse_args(argv)
    if args.deadline is None:
        args.deadline = steps.DEADLINE[args.run]
    if args.deadline <= 0:
        p.error("--deadline must be more than 0 seconds")
    # Given folders are relative to where the command runs; the defaults to the repository.
    for name, default in (("wheels", wheels.DEFAULT_DEST), ("out", DEFAULT_OUT), ("scratch", DEFAULT_SCRATCH)):
        value = getattr(args, name)
        setattr(args, name, os.path.abspath(value) if value else os.path.join(REPO, default))
    return args


@dataclasses.dataclass
class Facts:
    """What the kit found on the machine before running anything."""
    gpus: list  # [(name, driver, compute capability)]
    sanitizer: str
    ncu: str
    wheel_files: dict
    missing_wheels: list
    python: str
    cpus: int

    @property
    def hopper(self):
        return bool(self.gpus) and self.gpus[0][2] == "9.0"


# What a dry run on a machine without a GPU plans for: the lent machines (an H100 or H200,
# 16 cores, their own python3 with the CUDA tools on PATH).
LENT_MACHINE = {"gpus": [("the lent machine's Hopper GPU", "?", "9.0")], "sanitizer": "compute-sanitizer",
                "ncu": "ncu", "python": "python3", "cpus": 16}


def detect(args):
    found, missing = wheels.find_wheels(args.wheels)
    facts = Facts(machine.query_gpus(), machine.find_tool("compute-sanitizer") or "",
                  machine.find_tool("ncu") or "", found, missing, sys.executable, os.cpu_count() or 2)
    if args.dry_run and not facts.gpus:
        facts = dataclasses.replace(facts, **LENT_MACHINE)
    return facts


def find_site_dir(prefix, python_version=None):
    """Where pip put packages under `prefix` (lib/python3.X/site-packages, or a
    distribution's own layout such as local/lib/python3.X/dist-packages); a guess before
    anything is installed (for `python_version`, default this one)."""
    for root, dirs, _ in os.walk(prefix):
        if os.path.basename(root) in ("site-packages", "dist-packages") and any(d.endswith(".dist-info") for d in dirs):
            return root
        dirs.sort()
    version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    return os.path.join(prefix, "lib", f"python{version}", "site-packages")


def context(args, facts):
    return steps.Context(python=facts.python, repo=REPO, wheels=list(facts.wheel_files.values()),
                         scratch=args.scratch, site_dir=find_site_dir(os.path.join(args.scratch, "prefix")),
                         sanitizer=facts.sanitizer, ncu=facts.ncu, out=args.out, cpus=facts.cpus,
                         hopper=facts.hopper)


DEVICE_SCRATCH = "/tmp/groupgemm-kit"


def device_context(args, facts):
    """The context the device call's run will have: its paths, relative to the repository
    the machine runs in."""
    carried = [os.path.join(os.path.relpath(args.wheels, REPO), os.path.basename(w))
               for w in facts.wheel_files.values()] or [os.path.join(os.path.relpath(args.wheels, REPO), "*.whl")]
    prefix = os.path.join(DEVICE_SCRATCH, "prefix")
    return dataclasses.replace(context(args, facts), repo=".", wheels=carried, scratch=DEVICE_SCRATCH, out="$OUT",
                               site_dir=find_site_dir(prefix, wheels.TARGET_PYTHON))


def skip_reasons(run_name, facts):
    """{step: why it will be skipped} known before anything runs."""
    reasons = {}
    if not facts.gpus:
        reasons.update({name: "no CUDA GPU (nvidia-smi found none)" for name in steps.NEEDS_GPU})
    if not facts.sanitizer:
        reasons.setdefault("sanitizer", "compute-sanitizer not found (PATH, $CUDA_HOME/bin)")
    if not facts.ncu:
        reasons.setdefault("profile", "ncu not found (PATH, $CUDA_HOME/bin)")
    return {name: why for name, why in reasons.items() if name in steps.RUNS[run_name]}


def step_limits(run_name, deadline):
    """[(step, its limit, the latest second of the run it may end at)] in run order: each
    step's own limit, cut so that it ends by the run's deadline less the summary's reserve."""
    end, out, last = deadline - steps.SUMMARY_RESERVE_S, [], 0.0
    for name in steps.RUNS[run_name]:
        limit = min(steps.LIMITS[name], end)
        last = min(last + limit, end)
        out.append((name, limit, last))
    return out


# ---- the device call and the plan (--dry-run) -------------------------------------------

def device_call(args):
    """What the lent machine's tool gets: the command line, the folders to carry, its timeout."""
    wheels_dir = os.path.relpath(args.wheels, REPO)
    command = (f"PYTHONUNBUFFERED=1 python3 benchmarks/gpu/kit.py {args.run} --wheels {wheels_dir} "
               f"--out \"$OUT\" --scratch {DEVICE_SCRATCH} --deadline {args.deadline:.0f}")
    return {"command": command, "carry": [wheels_dir], "timeout_s": int(args.deadline) + 45}


def plan_text(args, facts, for_device=True):
    """The plan: the device call, what travels, and each step's limit, deadline and
    commands (`for_device`: with the device run's paths; else with this run's)."""
    ctx = device_context(args, facts) if for_device else context(args, facts)
    call = device_call(args)
    skipped = skip_reasons(args.run, facts)
    carried = sum(os.path.getsize(p) for p in facts.wheel_files.values())
    travelling = wheels.travel_bytes(REPO, [args.wheels])
    gpu = "; ".join(f"{name} (compute {cc}, driver {driver})" for name, driver, cc in facts.gpus)
    lines = [
        f"groupgemm lease kit, `{args.run}`, plan only (--dry-run): nothing is installed or run",
        "",
        "device call:",
        f"  command ({len(call['command'])} of {COMMAND_LIMIT} characters): {call['command']}",
        f"  carry: {', '.join(call['carry'])} ({carried / 2**20:.1f} MiB)",
        f"  timeout_s: {call['timeout_s']}",
        f"  travels in all: {travelling / 2**20:.1f} MiB (tracked and untracked files, and what is carried; "
        f"limit {wheels.TRAVEL_LIMIT_BYTES / 2**20:.0f} MiB)",
        "",
        f"wheels in {args.wheels}:",
    ]
    lines += [f"  found   {os.path.basename(path)} ({os.path.getsize(path) / 2**20:.1f} MiB)"
              for path in facts.wheel_files.values()]
    lines += [f"  MISSING {spec} (./dev.sh gpu-wheels makes them)" for spec in facts.missing_wheels]
    lines += ["", f"planned for: GPU {gpu}; python {facts.python}, {facts.cpus} cores; compute-sanitizer "
              f"{facts.sanitizer or 'not found'}; ncu {facts.ncu or 'not found'}",
              f"deadline {args.deadline:.0f} s (the summary's {steps.SUMMARY_RESERVE_S} s included); "
              f"results: {', '.join(results_dir.files(args.run))}", ""]
    for number, (name, limit, last) in enumerate(step_limits(args.run, args.deadline), start=1):
        lines.append(f"{number}. {name} (limit {limit:.0f} s, done by {last:.0f} s): {steps.PURPOSE[name]}")
        if name in skipped:
            lines.append(f"   here it would be SKIPPED: {skipped[name]}")
        side = " (side by side)" if name in steps.PARALLEL else ""
        for command in steps.commands(name, ctx):
            lines.append(f"   ${side} {runner.shell_line(command.argv, command.env)}")
    return "\n".join(lines)


# ---- running -------------------------------------------------------------------------------

class Run:
    """One run of the kit: its log, its clock, its verdicts, and what it learned about
    each kernel. `execute` runs one command (runner.run's signature) and `clock` tells
    the time; both are the real ones except in the kit's own tests."""

    def __init__(self, args, facts, log, execute=runner.run, clock=time.monotonic, parallel=True):
        self.args, self.facts, self.log = args, facts, log
        self._execute, self.clock, self.parallel = execute, clock, parallel
        self.started = clock()
        self.verdicts = []
        self.kernel_problems = {}  # {kernel: [why]}: from the tests and the sanitizer
        self.judged = set()  # the steps that judged every kernel (ran to their end)
        self.results = {}  # {step: data for the summary}

    def remaining(self):
        return self.args.deadline - steps.SUMMARY_RESERVE_S - (self.clock() - self.started)

    def execute(self, command, limit):
        print(f"[kit]   {command.label}: running (limit {limit:.0f} s)", flush=True)
        done = self._execute(command.argv, self.log, limit, command.env, cwd=REPO)
        self._tail(command, done)
        return done

    def execute_all(self, commands, limit):
        """The commands side by side (at most `steps.workers` at once), each with `limit`;
        their output lands in the log one command after another."""
        deadline = self.clock() + limit
        if not self.parallel or len(commands) < 2:  # one after another, within the same limit
            return [self.execute(c, max(deadline - self.clock(), 1)) for c in commands]
        width = max(1, self.facts.cpus // 2)
        print(f"[kit]   {len(commands)} commands side by side, {width} at a time (limit {limit:.0f} s)", flush=True)
        buffers = [io.StringIO() for _ in commands]
        with concurrent.futures.ThreadPoolExecutor(width) as pool:
            futures = [pool.submit(lambda c=c, b=b: self._execute(c.argv, b, max(deadline - self.clock(), 1),
                                                                   c.env, cwd=REPO))
                       for c, b in zip(commands, buffers)]
            done = [f.result() for f in futures]
        for command, buffer, result in zip(commands, buffers, done):
            self.log.write(buffer.getvalue())
            self._tail(command, result)
        self.log.flush()
        return done

    def _tail(self, command, done):
        if done.returncode != 0 or done.timed_out:
            print(f"[kit]   {command.label}: exit {done.returncode}" + (" (timed out)" if done.timed_out else ""))
            for line in done.output.splitlines()[-TAIL_LINES:]:
                print(f"[kit]   | {line}", flush=True)

    def blame(self, kernel, why):
        self.kernel_problems.setdefault(kernel, []).append(why)

    def record(self, step, status, reason, seconds):
        verdict = Verdict(step, status, reason, seconds)
        self.verdicts.append(verdict)
        line = f"[kit] {step}: {status} {reason} ({seconds:.0f} s)"
        self.log.write(f"\n{line}\n")
        self.log.flush()
        print(line, flush=True)
        return verdict


def last_error_line(output):
    """The line most likely to say why a command failed."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    specific = [line for line in lines if "Error:" in line or ": error" in line]
    errors = [line for line in lines if "error" in line.lower()]
    return (specific or errors or lines or [""])[-1][:200]


def timed_out_reason(done, limit):
    return f"timed out after {done.seconds:.0f} s (limit {limit:.0f} s)"


def run_install(run, ctx, limit):
    if run.facts.missing_wheels:
        return FAIL, f"missing in {run.args.wheels}: {', '.join(run.facts.missing_wheels)} (./dev.sh gpu-wheels)"
    done = run.execute(steps.commands("install", ctx)[0], limit)
    if done.timed_out:
        return FAIL, timed_out_reason(done, limit)
    if done.returncode != 0:
        return FAIL, f"pip exited {done.returncode}: {last_error_line(done.output)}"
    return PASS, f"installed {', '.join('-'.join(os.path.basename(w).split('-')[:2]) for w in ctx.wheels)}"


def pytest_part(done, limit, label):
    status, reason = verdicts.pytest_verdict(done.output, done.returncode, steps.EXPECTED_SKIPS)
    if done.timed_out:
        status, reason = FAIL, f"{timed_out_reason(done, limit)}; {reason}"
    return status, f"{label}: {reason}" if label else reason


def kernel_of_test(test_id):
    """The kernel a failed test ran on (its gemm_kernel fixture's id), or None."""
    params = re.search(r"\[(.*)\]$", test_id)
    ids = params.group(1).split("-") if params else []
    return next((k for k in steps.TEST_KERNELS if k in ids), None)


def run_gpu_tests(run, ctx, limit):
    (done,) = run.execute_all(steps.commands("gpu_tests", ctx), limit)
    status, reason = pytest_part(done, limit, "")
    failed = verdicts.failures(done.output)
    for test in failed:
        kernel = kernel_of_test(test)
        if kernel:
            run.blame(kernel, f"test {test}")
    if verdicts.parse_pytest_summary(done.output) is not None and not done.timed_out:
        run.judged.add("gpu_tests")
    by_kernel = {k: sum(kernel_of_test(t) == k for t in failed) for k in steps.TEST_KERNELS}
    blamed = ", ".join(f"{k}: {n}" for k, n in by_kernel.items() if n)
    return status, reason + (f"; failures by kernel: {blamed}" if blamed else "")


def run_sanitizer(run, ctx, limit):
    commands = steps.commands("sanitizer", ctx)
    parts, complete = [], True
    for command, done in zip(commands, run.execute_all(commands, limit)):
        tool, part = command.label.split(" ", 1)
        status, reason = (FAIL, f"{command.label}: {timed_out_reason(done, limit)}") if done.timed_out else \
            verdicts.sanitizer_tool_verdict(command.label, done.output, done.returncode)
        complete &= not done.timed_out
        if status != PASS:
            run.blame(part, f"{tool}: {reason}")
        parts.append((status, reason))
    if complete:
        run.judged.add("sanitizer")
    status, _ = verdicts.combine(parts)
    failed = [reason for s, reason in parts if s != PASS]
    return status, (f"{len(parts) - len(failed)} of {len(parts)} tool runs clean"
                    + (f"; {'; '.join(failed[:4])}" if failed else
                       f" ({len(steps.SANITIZER_TOOLS)} tools x {', '.join((*ctx.families, steps.LAYER_PART))})"))


def run_scripts(run, ctx, step, limit):
    """A step of check scripts, each judged by its RESULT line and exit status."""
    commands = steps.commands(step, ctx)
    done = run.execute_all(commands, limit) if step in steps.PARALLEL else None
    parts = []
    for i, command in enumerate(commands):
        if done is None:  # one after another, each with what is left
            left = limit - (run.clock() - run.step_started)
            if left < steps.MIN_STEP_S:
                parts.append((SKIP, f"{command.label}: out of time"))
                continue
            result = run.execute(command, left)
        else:
            result, left = done[i], limit
        if result.timed_out:
            parts.append((FAIL, f"{command.label}: {timed_out_reason(result, left)}"))
        else:
            parts.append(verdicts.script_verdict(command.label, result.output, result.returncode))
    return verdicts.combine(parts)


def passed_kernels(run):
    """The kernel table's kernels that passed the tests and the sanitizer (both judged
    every kernel): the candidates of the decision. A failure on the default kernels or on
    the sm90 kernels by shape (which run the table's own choices) withholds every tile."""
    if not {"gpu_tests", "sanitizer"} <= run.judged:
        return set(), "the tests or the sanitizer did not finish"
    table_kernels = (kernel_table.SM80, *kernel_table.read().tile_names)
    passed = {k for k in table_kernels if k not in run.kernel_problems}
    withheld = [k for k in (steps.DEFAULT_KERNEL, kernel_table.SM90_BY_SHAPE) if k in run.kernel_problems]
    if withheld:
        passed &= {kernel_table.SM80}
    why = ", ".join(f"{k} ({run.kernel_problems[k][0]})" for k in (*table_kernels, *withheld)
                    if k in run.kernel_problems)
    return passed, f"failed: {why}" if why else "every kernel passed"


def run_decision(run, ctx, _limit):
    """The kernel table's choices from the tile sweep of the kernels that passed, written
    into the source's table (so that a GPU machine with the repository keeps it) and, for
    the session that holds the lease, into the results."""
    table = kernel_table.read()
    passed, why = passed_kernels(run)
    tiles_csv = os.path.join(ctx.out, results_dir.TILES_CSV)
    import tile_sweep  # reads the sweep's CSV; standard library
    timings = tile_sweep.read_timings(tiles_csv) if os.path.exists(tiles_csv) else []
    choices, reasons = kernel_table.decide(table, timings, passed)
    run.results["decision"] = {"passed": sorted(passed), "why": why, "reasons": {str(k): v for k, v in reasons.items()},
                               "before": [dataclasses.asdict(c) for c in table.choices],
                               "after": [dataclasses.asdict(c) for c in choices]}
    if not timings:
        return INCOMPLETE, f"no tile sweep: the table is unchanged; {why}"
    gpu = run.facts.gpus[0][0] if run.facts.gpus else "a GPU"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    chosen_by = (f"the GPU kit on {gpu}, {when}: per class, the fastest (the sum of its GEMMs' CUDA-event "
                 f"medians at the benchmark's cells, benchmarks/results/gpu/tiles.csv) of the kernels that "
                 f"passed tests/test_cuda.py and compute-sanitizer: {', '.join(sorted(passed)) or 'none'}.")
    changed = choices != table.choices
    if changed:
        kernel_table.write_choices(choices, chosen_by)
    shutil.copyfile(kernel_table.TABLE, os.path.join(ctx.out, results_dir.KERNEL_TABLE))
    rows = "; ".join(f"<= {c.smaller_side_at_most or 'any'}: {c.default} (sm90 {c.sm90})" for c in choices)
    return PASS, f"{'changed' if changed else 'unchanged'}: {rows}; {why}"


def read_results(path):
    """What a benchmark wrote (transformers_experts.py, expert_mlp_fused.py: its rows after
    every cell it finished), or {}."""
    try:
        with open(path) as f:
            document = json.load(f)
        return document if isinstance(document, dict) and isinstance(document.get("results"), list) else {}
    except (OSError, ValueError):
        return {}


def run_benchmark(run, ctx, limit, step, json_name, judge):
    """A benchmark step judged by the cells it wrote back (its JSON, rewritten after every
    cell): judge(rows) gives the wrong cells, the timed and the planned cell counts and a
    digest of the timed ones. A wrong cell fails the step; a run stopped at its limit
    reports the cells it finished."""
    path = os.path.join(ctx.out, json_name)
    if os.path.exists(path):
        os.remove(path)  # an earlier run's cells are not this run's
    (command,) = steps.commands(step, ctx)
    done = run.execute(command, limit)
    wrong, timed, planned, digest = judge(read_results(path).get("results", []))
    found = f"{timed} of {planned} cells" + (f"; {digest}" if timed else "")
    if wrong:
        return FAIL, f"{'; '.join(wrong[:3])}; {found}"
    if done.timed_out:
        return (INCOMPLETE if timed else FAIL), f"{timed_out_reason(done, limit)}; {found}"
    if done.returncode != 0:
        return FAIL, f"exited {done.returncode}: {last_error_line(done.output)}; {found}"
    return (PASS if timed == planned else INCOMPLETE), found


def transformers_cells(rows):
    """transformers' experts implementations against groupgemm: a cell where an
    implementation disagrees with eager, or groupgemm fails, is wrong."""
    planned = transformers_report.planned_cells(
        [steps.TRANSFORMERS_DTYPE], steps.TRANSFORMERS_TRAIN_TOKENS, steps.TRANSFORMERS_DECODE_TOKENS)
    cells = transformers_report.cells(rows)
    timed = [cell for cell in planned if "ms" in cells.get(cell, {}).get(transformers_report.GROUPGEMM, {})]
    wrong = [f"{r['impl']} {r['phase']} T={r['tokens']}: {r.get('error') or 'disagrees with eager'}" for r in rows
             if r.get("check") == "FAIL" or (r["impl"] == transformers_report.GROUPGEMM and r.get("error"))]
    return wrong, len(timed), len(planned), f"fastest built-in / groupgemm: {transformers_report.digest(rows)}"


def fused_cells(hopper):
    """The fused expert MLP against its composition: a cell where the two disagree is wrong;
    the digest gives each timed cell's fused / composed time."""
    planned = expert_mlp_report.planned_cells(steps.FUSED_FRAMEWORKS, steps.FUSED_SHAPES, [steps.FUSED_DTYPE],
                                              steps.mlp_families_on(hopper))

    def judge(rows):
        timed = [r for r in rows if expert_mlp_report.cell(r) in planned and "ms_ratio" in r]
        wrong = [f"{' '.join(expert_mlp_report.cell(r))}: fused and composed disagree ({r['max_rel_error']:.1e})"
                 for r in rows if r.get("check") == "FAIL"]
        return wrong, len(timed), len(planned), f"fused / composed time: {expert_mlp_report.digest(timed)}"

    return judge


def run_step(run, ctx, name, limit):
    if name == "install":
        return run_install(run, ctx, limit)
    if name == "gpu_tests":
        return run_gpu_tests(run, ctx, limit)
    if name == "sanitizer":
        return run_sanitizer(run, ctx, limit)
    if name in ("environment", "capture", "bench", "profile"):
        return run_scripts(run, ctx, name, limit)
    if name == "suite":
        (done,) = run.execute_all(steps.commands("suite", ctx), limit)
        return pytest_part(done, limit, "")
    if name == "decision":
        return run_decision(run, ctx, limit)
    if name == "fused":
        return run_benchmark(run, ctx, limit, name, results_dir.FUSED_JSON, fused_cells(ctx.hopper))
    if name == "transformers":
        return run_benchmark(run, ctx, limit, name, results_dir.TRANSFORMERS_JSON, transformers_cells)
    raise ValueError(name)


def run_all(run, args, facts):
    ctx = context(args, facts)
    skipped = skip_reasons(args.run, facts)
    for name in steps.RUNS[args.run]:
        print(f"[kit] {name}: {steps.PURPOSE[name]}", flush=True)
        if name in skipped:
            run.record(name, SKIP, skipped[name], 0)
            continue
        install = next((v for v in run.verdicts if v.step == "install"), None)
        if name != "install" and install and install.status != PASS:
            run.record(name, SKIP, "the install failed", 0)
            continue
        limit = min(steps.LIMITS[name], run.remaining())
        if limit < steps.MIN_STEP_S:
            run.record(name, SKIP, f"out of time ({max(run.remaining(), 0):.0f} s left of the deadline)", 0)
            continue
        run.step_started = run.clock()
        try:
            status, reason = run_step(run, ctx, name, limit)
        except Exception as exc:  # a bug in one step must not lose the others' verdicts
            status, reason = FAIL, f"the kit failed: {type(exc).__name__}: {exc}"
        run.record(name, status, reason, run.clock() - run.step_started)
        if name == "install":
            ctx = context(args, facts)  # pip has now made the prefix: find its packages
    return run.verdicts


# ---- results -------------------------------------------------------------------------------

def bench_targets(out):
    """The benchmark's targets table, from its bench.json in `out`, or ""."""
    try:
        with open(os.path.join(out, "bench.json")) as f:
            rows = json.load(f)["results"]
    except (OSError, ValueError, KeyError):
        return ""
    import report  # benchmarks/report.py: standard library
    return report.targets_table(rows)


def transformers_section(out):
    """The transformers cells' table, from transformers_experts.py's JSON in `out`, or ""."""
    document = read_results(os.path.join(out, results_dir.TRANSFORMERS_JSON))
    if not document.get("results"):
        return ""
    shape = ", ".join(f"{name} {value}" for name, value in document.get("shape", {}).items())
    gpu = document.get("machine", {}).get("gpu", "the GPU")
    return (f"## transformers {document.get('transformers', '')} experts implementations\n\n"
            f"Qwen3MoeExperts ({shape}) on {gpu}; medians of interleaved calls; a ratio above 1 is groupgemm "
            f"faster.\n\n" + transformers_report.markdown_table(document["results"]))


def fused_section(out):
    """The fused expert MLP's cells as a table, from expert_mlp_fused.py's JSON in `out`, or ""."""
    document = read_results(os.path.join(out, results_dir.FUSED_JSON))
    if not document.get("results"):
        return ""
    gpu = document.get("machine", {}).get("gpu", "the GPU")
    return (f"## The fused expert MLP against its composition\n\n`{document.get('command', '')}` on {gpu}; "
            f"SwiGLU, forward+backward, skewed routing with every fourth expert idle; a ratio below 1 is the "
            f"fused op smaller or faster.\n\n" + expert_mlp_report.markdown_table(document["results"]))


def write_summary(run, args, argv):
    facts = run.facts
    gpu = "; ".join(f"{name} (compute {cc}, driver {driver})" for name, driver, cc in facts.gpus) or "no GPU"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "./dev.sh gpu " + " ".join(argv)
    sections = [f"# groupgemm lease kit: {args.run}", "", f"`{command.strip()}`, {when}, {gpu}", "",
                verdicts.render_table(run.verdicts)]
    decision = run.results.get("decision")
    if decision:
        sections += ["", "## The kernel table's decision", "", f"Candidates: {', '.join(decision['passed']) or 'none'} "
                     f"({decision['why']}).", ""]
        sections += [f"- class up to {k if k != '0' else 'any'}: {v}" for k, v in decision["reasons"].items()]
    targets = bench_targets(args.out) if args.run == "check" else ""
    if targets:
        sections += ["", "## " + targets]
    for step, section in (("fused", fused_section), ("transformers", transformers_section)):
        table = section(args.out) if step in steps.RUNS[args.run] else ""
        if table:
            sections += ["", table]
    text = "\n".join(sections) + "\n"
    with open(os.path.join(args.out, results_dir.summary_md(args.run)), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, results_dir.summary_json(args.run)), "w") as f:
        json.dump({"command": command.strip(), "when": when, "gpus": facts.gpus, "run": args.run,
                   "verdicts": [dataclasses.asdict(v) for v in run.verdicts],
                   "kernel_problems": run.kernel_problems, **run.results}, f, indent=1)
    return text


def main(argv=None, execute=runner.run, clock=time.monotonic, parallel=True):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    facts = detect(args)
    if args.dry_run:
        print(plan_text(args, facts))
        return 0
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    with open(os.path.join(args.out, results_dir.log(args.run)), "w") as log:
        log.write(plan_text(args, facts, for_device=False).replace(
            "plan only (--dry-run): nothing is installed or run", "run") + "\n")
        run = Run(args, facts, log, execute, clock, parallel)
        run_all(run, args, facts)
    text = write_summary(run, args, argv)
    print("\n" + text)
    for problem in results_dir.budget_problems(args.out):
        print(f"[kit] results folder: {problem}")
    print(f"[kit] results in {args.out}")
    return 1 if any(v.status in (FAIL, INCOMPLETE) for v in run.verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
