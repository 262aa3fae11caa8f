"""What each run of the lease kit leaves in its results folder, and the budget it keeps
there: at most 8 files, at most 2 folders down, so that the folder comes back whole from
a lent machine. Standard library only."""

import os

NCU_CSV = "ncu.csv"  # Nsight Compute's raw figures behind the profile
PROFILE_MD = "profile.md"  # one MoE shape's timings and kernels
BENCH_FILES = ("bench.csv", "bench.json", "bench.png")  # the frameworks' benchmark at the core cells
TILES_CSV = "tiles.csv"  # each GEMM per kernel: the kernel table's evidence
KERNEL_TABLE = "hopper_kernels.def"  # the kernel table with the run's choices
TRANSFORMERS_JSON = "transformers_experts.json"  # transformers' experts implementations against groupgemm
FUSED_JSON = "expert_mlp_fused.json"  # the fused expert MLP against its composition


def log(run):
    return f"{run}.log"  # every command and its full output


def summary_md(run):
    return f"{run}.md"  # the verdicts, the decision, the targets


def summary_json(run):
    return f"{run}.json"  # the same for scripts, with the machine


def files(run):
    """Every file a run writes."""
    own = {"check": (*BENCH_FILES, TILES_CSV, KERNEL_TABLE),
           "extra": (PROFILE_MD, NCU_CSV, FUSED_JSON, TRANSFORMERS_JSON)}[run]
    return (log(run), summary_md(run), summary_json(run), *own)


MAX_FILES = 8
MAX_DEPTH = 2  # folders below the results folder


def budget_problems(out_dir, max_files=MAX_FILES, max_depth=MAX_DEPTH):
    """What breaks the budget: more than max_files files, or a file more than max_depth
    folders deep. Empty when the folder keeps it (or does not exist)."""
    found = []
    for root, _, names in os.walk(out_dir):
        for name in names:
            found.append(os.path.relpath(os.path.join(root, name), out_dir))
    problems = []
    if len(found) > max_files:
        problems.append(f"{len(found)} files in {out_dir}, at most {max_files}")
    for path in sorted(found):
        depth = len(path.split(os.sep)) - 1
        if depth > max_depth:
            problems.append(f"{path} is {depth} folders deep, at most {max_depth}")
    return problems
