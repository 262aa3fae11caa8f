"""What the kit leaves in its results folder, and the budget it keeps there: a few small
files, so that the folder can be taken away whole."""

import os

LOG = "kit.log"  # every command and its full output
SUMMARY_MD = "summary.md"  # the verdict table
SUMMARY_JSON = "summary.json"  # the verdicts and the machine, for scripts
BENCH_FILES = ("bench.csv", "bench.json", "bench.png")  # the merged benchmark sweep
PROFILE_MD = "profile.md"  # one MoE shape's timings and kernels (profile step)
NCU_CSV = "ncu.csv"  # Nsight Compute's raw figures behind it
KIT_FILES = (LOG, SUMMARY_MD, SUMMARY_JSON) + BENCH_FILES + (PROFILE_MD, NCU_CSV)

MAX_FILES = 8
MAX_DEPTH = 2  # folders below the results folder


def budget_problems(out_dir, max_files=MAX_FILES, max_depth=MAX_DEPTH):
    """What breaks the budget: more than max_files files, or a file more than max_depth
    folders deep. Empty when the folder keeps it (or does not exist)."""
    files = []
    for root, _, names in os.walk(out_dir):
        for name in names:
            files.append(os.path.relpath(os.path.join(root, name), out_dir))
    problems = []
    if len(files) > max_files:
        problems.append(f"{len(files)} files in {out_dir}, at most {max_files}")
    for path in sorted(files):
        depth = len(path.split(os.sep)) - 1
        if depth > max_depth:
            problems.append(f"{path} is {depth} folders deep, at most {max_depth}")
    return problems
