"""The GPU kit: one command that checks groupgemm's CUDA backend on a machine with an
NVIDIA GPU and no network, and leaves a few result files behind.

    ./dev.sh gpu [--wheels DIR] [--out DIR] [--quick] [--dry-run] [--steps NAME...]

It runs under the machine's own python3 (which brings torch, jax with its CUDA plugin,
nanobind, scikit-build-core, cmake, ninja, pytest), never installs torch or jax, and:
  setup: installs the copied wheels (./dev.sh gpu-wheels) into a scratch prefix and
         builds groupgemm there for the local GPU's architecture;
  1. environment   2. pytest   3. sanitizer   4. capture   5. bench   6. profile
  (see steps.py)
Every step runs even when an earlier one failed (steps that need the build are skipped
when it failed), each under a time limit, and gets a one-line verdict. The summary
table is printed last and written, with the full log, the benchmark's CSV, JSON and
PNG and the profile's report, to --out. Verdicts of steps not run this time are kept
from earlier runs that used the same scratch folder, so a run cut short by its deadline
is completed with --steps.
Standard library only.
"""

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import machine  # noqa: E402
import results_dir  # noqa: E402
import runner  # noqa: E402
import steps  # noqa: E402
import verdicts  # noqa: E402
import wheels  # noqa: E402
from verdicts import FAIL, INCOMPLETE, PASS, SKIP, Verdict  # noqa: E402

REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
DEFAULT_OUT = os.path.join("benchmarks", "results", "gpu")
DEFAULT_SCRATCH = os.path.join("build", "gpu-kit")
STATE = "verdicts.json"  # in the scratch folder: verdicts kept across runs
MIN_STEP_S = 20  # a step with less time than this left is skipped, not started
TAIL_LINES = 15  # of a failing command's output, echoed to the terminal


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="./dev.sh gpu", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check groupgemm's CUDA backend on this machine's GPU, offline.",
        epilog="steps: " + "; ".join(f"{name}: {steps.PURPOSE[name]}" for name in steps.STEPS))
    p.add_argument("--wheels",
                   help=f"the wheels folder, from ./dev.sh gpu-wheels (default {wheels.DEFAULT_DEST})")
    p.add_argument("--out", help=f"folder for the log, summary and benchmark files, at most 8 (default {DEFAULT_OUT})")
    p.add_argument("--scratch", help=f"folder for the prefix, the build and kept verdicts (default {DEFAULT_SCRATCH})")
    p.add_argument("--quick", action="store_true",
                   help="the CUDA tests and case-table tests only, fewer sanitizer cases, a small benchmark; "
                        "ends within 8 minutes")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands; build and run nothing")
    p.add_argument("--steps", nargs="+", choices=steps.SELECTABLE, default=list(steps.SELECTABLE), metavar="STEP",
                   help=f"run only these of {', '.join(steps.SELECTABLE)} (the setup always runs)")
    p.add_argument("--deadline", type=float, metavar="SECONDS",
                   help=f"end every step by this many seconds (default {steps.DEADLINE[True]} with --quick, "
                        f"{steps.DEADLINE[False]} without; 0: no deadline)")
    p.add_argument("--arch", help="CMAKE_CUDA_ARCHITECTURES (default: from the GPU, e.g. 90a on an H100)")
    args = p.parse_args(argv)
    if args.deadline is None:
        args.deadline = steps.DEADLINE[args.quick]
    if args.deadline < 0:
        p.error("--deadline must be 0 or more seconds")
    # Given folders are relative to where the command runs; the defaults to the repository.
    for name, default in (("wheels", wheels.DEFAULT_DEST), ("out", DEFAULT_OUT), ("scratch", DEFAULT_SCRATCH)):
        value = getattr(args, name)
        setattr(args, name, os.path.abspath(value) if value else os.path.join(REPO, default))
    return args


@dataclasses.dataclass
class Facts:
    """What the kit found on the machine before running anything."""
    gpus: list
    arch: str
    sanitizer: str
    wheel_files: dict
    missing_wheels: list
    python: str
    ncu: str  # Nsight Compute's command-line profiler, or "" when missing


def detect(args):
    gpus = machine.query_gpus()
    arch = args.arch or machine.architecture_for(gpus, sys.executable)
    found, missing = wheels.find_wheels(args.wheels)
    return Facts(gpus, arch, machine.find_tool("compute-sanitizer") or "", found, missing, sys.executable,
                 machine.find_tool("ncu") or "")


def find_site_dir(prefix):
    """Where pip put packages under `prefix` (lib/python3.X/site-packages, or a
    distribution's own layout such as local/lib/python3.X/dist-packages); a guess before
    anything is installed."""
    for root, dirs, _ in os.walk(prefix):
        if os.path.basename(root) in ("site-packages", "dist-packages") and any(d.endswith(".dist-info") for d in dirs):
            return root
        dirs.sort()
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return os.path.join(prefix, "lib", version, "site-packages")


def context(args, facts):
    prefix = os.path.join(args.scratch, "prefix")
    return steps.Context(python=facts.python, repo=REPO, wheels=list(facts.wheel_files.values()),
                         scratch=args.scratch, site_dir=find_site_dir(prefix), arch=facts.arch,
                         sanitizer=facts.sanitizer, ncu=facts.ncu, out=args.out, quick=args.quick)


def skip_reasons(args, facts):
    """{step: why it will be skipped} known before anything runs."""
    reasons = {name: ["not selected (--steps)"] for name in steps.SELECTABLE if name not in args.steps}
    if not facts.gpus:
        for name in steps.NEEDS_GPU:
            reasons.setdefault(name, []).append("no CUDA GPU (nvidia-smi found none)")
    if not facts.sanitizer:
        reasons.setdefault("sanitizer", []).append("compute-sanitizer not found (PATH, $CUDA_HOME/bin)")
    if not facts.ncu:
        reasons.setdefault("profile", []).append("ncu not found (PATH, $CUDA_HOME/bin)")
    return {name: "; ".join(why) for name, why in reasons.items()}


# ---- the plan (--dry-run) ----------------------------------------------------------------

def plan_text(args, facts):
    ctx = context(args, facts)
    skipped = skip_reasons(args, facts)
    gpu = ("; ".join(f"{name} (compute {cc}, driver {driver})" for name, driver, cc in facts.gpus)
           or "none: nvidia-smi found no GPU")
    lines = [
        "groupgemm GPU kit, plan only (--dry-run): nothing is installed, built or run",
        f"GPU: {gpu}",
        f"CMAKE_CUDA_ARCHITECTURES: {facts.arch}"
        + ("" if facts.gpus or args.arch else " (no GPU to ask: the default)"),
        f"python: {facts.python}",
        f"compute-sanitizer: {facts.sanitizer or 'not found'}",
        f"ncu: {facts.ncu or 'not found'}",
        f"wheels in {args.wheels}:",
    ]
    lines += [f"  found   {os.path.basename(path)}" for path in facts.wheel_files.values()]
    lines += [f"  MISSING {spec} (run ./dev.sh gpu-wheels where there is network)" for spec in facts.missing_wheels]
    lines += [f"scratch: {args.scratch} (packages in {ctx.site_dir})",
              f"results: {args.out} ({', '.join(results_dir.KIT_FILES)})",
              f"mode: {'quick' if args.quick else 'full'}; deadline "
              + (f"{args.deadline:.0f} s" if args.deadline else "none"), ""]
    number = {name: f"{i}." for i, name in enumerate(steps.SELECTABLE, start=1)}
    for name in steps.STEPS:
        label = number.get(name, "setup:")
        lines.append(f"{label} {name}: {steps.PURPOSE[name]} (limit {steps.timeout(name, args.quick)} s)")
        if name in skipped:
            lines.append(f"   would be SKIPPED: {skipped[name]}")
            if name not in args.steps:
                continue
            lines.append("   where it runs, it runs:")
        for command in steps.commands(name, ctx):
            if name == "wheels" and not command.argv[-1].endswith(".whl"):
                lines.append("   (no wheel to install)")
                continue
            lines.append(f"   $ {runner.shell_line(command.argv, command.env)}")
    if not facts.gpus:
        lines.append(f"\nno GPU: steps 2-{len(steps.SELECTABLE)} ({', '.join(steps.NEEDS_GPU)}) would be skipped")
    return "\n".join(lines)


# ---- running ------------------------------------------------------------------------------

class Run:
    """One run of the kit: its log, its clock and the verdicts so far."""

    def __init__(self, args, facts, log):
        self.args, self.facts, self.log = args, facts, log
        self.started = time.monotonic()
        self.verdicts = []

    def remaining(self):
        if not self.args.deadline:
            return float("inf")
        return self.args.deadline - (time.monotonic() - self.started)

    def execute(self, command, limit):
        print(f"[kit]   {command.label or command.argv[0]}: running (limit {limit:.0f} s)", flush=True)
        done = runner.run(command.argv, self.log, limit, command.env, cwd=REPO)
        if done.returncode != 0 or done.timed_out:
            tail = done.output.splitlines()[-TAIL_LINES:]
            print("\n".join(f"[kit]   | {line}" for line in tail), flush=True)
        return done

    def record(self, step, status, reason, seconds):
        verdict = Verdict(step, status, reason, seconds)
        self.verdicts.append(verdict)
        self.log.write(f"\n[kit] {step}: {status} {reason} ({seconds:.0f} s)\n")
        self.log.flush()
        print(f"[kit] {step}: {status} {reason} ({seconds:.0f} s)", flush=True)
        return verdict


def last_error_line(output):
    """The line most likely to say why a command failed: a compiler's or CMake's error
    first (pip's own closing lines only say that the build failed), else any error."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    specific = [line for line in lines if ": error" in line or "CMake Error" in line or "Error:" in line]
    errors = [line for line in lines if "error" in line.lower()]
    return (specific or errors or lines or [""])[-1][:200]


def timed_out_reason(done, limit):
    return f"timed out after {done.seconds:.0f} s (limit {limit:.0f} s)"


def run_wheels(run, ctx):
    facts = run.facts
    installed = [f"{n.replace('-', '_')}-{v}.dist-info" for n, v in wheels.REQUIRED]
    present = os.path.isdir(ctx.site_dir) and set(installed) <= set(os.listdir(ctx.site_dir))
    if present:
        return PASS, f"already installed in {ctx.site_dir}"
    if not facts.wheel_files:
        return FAIL, f"no wheels in {run.args.wheels}: run ./dev.sh gpu-wheels where there is network"
    done = run.execute(steps.commands("wheels", ctx)[0], min(steps.timeout("wheels", ctx.quick), run.remaining()))
    if done.timed_out:
        return FAIL, timed_out_reason(done, steps.timeout("wheels", ctx.quick))
    if done.returncode != 0:
        return FAIL, f"pip exited {done.returncode}: {last_error_line(done.output)}"
    missing = f"; missing {', '.join(facts.missing_wheels)}" if facts.missing_wheels else ""
    status = FAIL if facts.missing_wheels else PASS
    return status, f"installed {len(facts.wheel_files)} wheels into {ctx.prefix}{missing}"


def run_single(run, ctx, step, judge):
    """A step of one command, judged by judge(done) -> (status, reason)."""
    limit = min(steps.timeout(step, ctx.quick), run.remaining())
    done = run.execute(steps.commands(step, ctx)[0], limit)
    status, reason = judge(done)
    if done.timed_out:
        return FAIL, f"{timed_out_reason(done, limit)}; {reason}"
    return status, reason


def run_sanitizer(run, ctx):
    commands = steps.commands("sanitizer", ctx)
    budget_end = time.monotonic() + min(steps.timeout("sanitizer", ctx.quick), run.remaining())
    parts, driver = [], ""
    for i, command in enumerate(commands):
        limit = (budget_end - time.monotonic()) / (len(commands) - i)
        if limit < MIN_STEP_S:
            parts.append((SKIP, f"{command.label}: out of time"))
            continue
        done = run.execute(command, limit)
        if done.timed_out:
            parts.append((FAIL, f"{command.label}: {timed_out_reason(done, limit)}"))
            continue
        parts.append(verdicts.sanitizer_tool_verdict(command.label, done.output, done.returncode))
        result = verdicts.result_line(done.output)
        driver = driver or (result[1] if result else "")
    status, reason = verdicts.combine(parts)
    return status, reason + (f"; driver: {driver}" if driver else "")


def run_checks(run, ctx, step):
    """A step of several commands (pytest, capture, profile), each judged by pytest's
    summary (which pytest still prints when stopped at its limit) or its RESULT line,
    each given its share of the step's time that is left."""
    commands = steps.commands(step, ctx)
    budget_end = time.monotonic() + min(steps.timeout(step, ctx.quick), run.remaining())
    parts = []
    for i, command in enumerate(commands):
        limit = (budget_end - time.monotonic()) * command.share / sum(c.share for c in commands[i:])
        if limit < 5:
            parts.append((SKIP, f"{command.label}: out of time"))
            continue
        done = run.execute(command, limit)
        if command.argv[1:3] == ["-m", "pytest"]:
            status, reason = verdicts.pytest_verdict(done.output, done.returncode, steps.EXPECTED_SKIPS)
            if done.timed_out:
                status, reason = FAIL, f"{timed_out_reason(done, limit)}; {reason}"
            parts.append((status, f"{command.label}: {reason}"))
        elif done.timed_out:
            parts.append((FAIL, f"{command.label}: {timed_out_reason(done, limit)}"))
        else:
            parts.append(verdicts.script_verdict(command.label, done.output, done.returncode))
    return verdicts.combine(parts)


def run_bench(run, ctx):
    *sweep, merge = steps.commands("bench", ctx)
    budget_end = time.monotonic() + min(steps.timeout("bench", ctx.quick), run.remaining())
    parts = []
    for command in sweep:
        limit = budget_end - time.monotonic() - steps.MERGE_RESERVE_S
        if limit < MIN_STEP_S:
            parts.append((SKIP, f"{command.label}: out of time"))
            continue
        done = run.execute(command, limit)
        if done.timed_out:
            parts.append((FAIL, f"{command.label}: {timed_out_reason(done, limit)}"))
        elif done.returncode != 0:
            parts.append((FAIL, f"{command.label}: {os.path.basename(command.argv[1])} exited {done.returncode}: "
                                f"{last_error_line(done.output)}"))
    done = run.execute(merge, max(budget_end - time.monotonic(), steps.MERGE_RESERVE_S))
    merged = verdicts.script_verdict("sweep", done.output, done.returncode)
    status, reason = verdicts.combine(parts + [merged])
    return status, reason


def run_step(run, ctx, step):
    if step == "wheels":
        return run_wheels(run, ctx)
    if step == "build":
        def judge(done):
            if done.returncode == 0:
                return PASS, f"built for CMAKE_CUDA_ARCHITECTURES={ctx.arch} into {ctx.prefix}"
            return FAIL, f"pip exited {done.returncode}: {last_error_line(done.output)}"
        return run_single(run, ctx, "build", judge)
    if step == "environment":
        return run_single(run, ctx, step, lambda d: verdicts.script_verdict("", d.output, d.returncode))
    if step == "sanitizer":
        return run_sanitizer(run, ctx)
    if step in ("pytest", "capture", "profile"):
        return run_checks(run, ctx, step)
    if step == "bench":
        return run_bench(run, ctx)
    raise ValueError(step)


def run_all(args, facts, log):
    run = Run(args, facts, log)
    ctx = context(args, facts)
    skipped = skip_reasons(args, facts)
    for name in steps.STEPS:
        if name in args.steps or name in steps.PREREQUISITES:
            print(f"[kit] {name}: {steps.PURPOSE[name]}", flush=True)
        if name in skipped:
            if name in args.steps:  # unselected steps keep their earlier verdicts
                run.record(name, SKIP, skipped[name], 0)
            continue
        build = next((v for v in run.verdicts if v.step == "build"), None)
        if build and build.status != PASS:
            run.record(name, SKIP, "the build failed" if build.status == FAIL else "nothing was built", 0)
            continue
        if run.remaining() < MIN_STEP_S:
            run.record(name, SKIP, f"out of time: run again with --steps {name}", 0)
            continue
        started = time.monotonic()
        try:
            status, reason = run_step(run, ctx, name)
        except Exception as exc:  # a bug in one step must not lose the others' verdicts
            status, reason = FAIL, f"the kit failed: {type(exc).__name__}: {exc}"
        run.record(name, status, reason, time.monotonic() - started)
        if name == "wheels":
            ctx = context(args, facts)  # pip has now made the prefix: find its packages
    return run.verdicts


# ---- results ------------------------------------------------------------------------------

def merge_with_earlier(current, earlier):
    """This run's verdicts, plus earlier runs' verdicts of the steps this run did not
    run (not selected with --steps), marked as earlier; in step order."""
    by_step = {v.step: dataclasses.replace(v, earlier=True) for v in earlier}
    by_step.update({v.step: v for v in current})
    return [by_step[name] for name in steps.STEPS if name in by_step]


def load_state(scratch):
    try:
        with open(os.path.join(scratch, STATE)) as f:
            return [Verdict(**{**item, "earlier": False}) for item in json.load(f)]
    except (OSError, ValueError, TypeError):
        return []


def save_state(scratch, merged):
    os.makedirs(scratch, exist_ok=True)
    with open(os.path.join(scratch, STATE), "w") as f:
        json.dump([dataclasses.asdict(v) for v in merged], f, indent=1)


def write_summary(args, facts, merged, argv):
    table = verdicts.render_table(merged)
    command = "./dev.sh gpu " + " ".join(argv)
    gpu = "; ".join(f"{name} (compute {cc}, driver {driver})" for name, driver, cc in facts.gpus) or "no GPU"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    with open(os.path.join(args.out, results_dir.SUMMARY_MD), "w") as f:
        f.write(f"# groupgemm GPU kit\n\n`{command.strip()}`, {when}, {gpu}, "
                f"CMAKE_CUDA_ARCHITECTURES={facts.arch}\n\n{table}\n")
    with open(os.path.join(args.out, results_dir.SUMMARY_JSON), "w") as f:
        json.dump({"command": command.strip(), "when": when, "gpus": facts.gpus, "arch": facts.arch,
                   "quick": args.quick, "verdicts": [dataclasses.asdict(v) for v in merged]}, f, indent=1)
    return table


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    facts = detect(args)
    if args.dry_run:
        print(plan_text(args, facts))
        return 0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, results_dir.LOG), "w") as log:
        log.write(plan_text(args, facts).replace("plan only (--dry-run): nothing is installed, built or run",
                                                 "run") + "\n")
        current = run_all(args, facts, log)
    merged = merge_with_earlier(current, load_state(args.scratch))
    save_state(args.scratch, merged)
    table = write_summary(args, facts, merged, argv)
    print("\n" + table)
    for problem in results_dir.budget_problems(args.out):
        print(f"[kit] results folder: {problem}")
    print(f"\n[kit] results in {args.out}")
    incomplete = [v.step for v in merged if v.status == INCOMPLETE and not v.earlier]
    if incomplete:
        print(f"[kit] incomplete (a part did not run, so PASS is not claimed): {', '.join(incomplete)}")
    return 1 if any(v.status in (FAIL, INCOMPLETE) for v in merged if not v.earlier) else 0


if __name__ == "__main__":
    sys.exit(main())
