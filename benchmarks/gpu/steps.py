"""The lease kit's steps and the exact commands each runs, built from the run's settings.
Kept apart from running them so --dry-run prints the same commands a real run executes.
Standard library only.

Two commands fit a 15-minute lease: `check` (at most 540 s: the carried wheels installed,
then correctness on every kernel, then the measurements and the kernel table's decision)
and `extra` (at most 240 s: the profile under Nsight Compute, the rest of the suite, the
fused expert MLP against its composition, transformers' experts implementations against
groupgemm). The steps of each run in priority order, each within its own limit, under one
deadline.
"""

import dataclasses
import os
import sys

import results_dir

# DEFAULT_KERNEL and TEST_KERNELS are the kit's too: it reads failed tests by them.
from driver_calls import DEFAULT_KERNEL, TEST_KERNELS, mlp_families_on  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import kernel_table  # noqa: E402
from contenders import GROUPGEMM_DENSE, PER_EXPERT_LOOP, RAGGED_DOT, family_contender  # noqa: E402

# In priority order: what a run cut short by its deadline leaves out comes last.
# extra holds what does not fit check: the lease has room for no third command (the
# machine's start, check's 540 s and extra's 240 s fill its 15 minutes), check's limits
# already add up to more than its deadline and its results are 8 files, the most that come
# back. The fused expert MLP's cells come right after the profile (whether the fused op
# becomes the layers' CUDA default waits on them; they take well under their limit), then
# the rest of the suite; the transformers cells come last. The steps before them usually end
# well inside their limits (the profile took 23 s on the last H100 run; the suite may take
# its whole 110 s), so the cells get what those leave, a minute or so; with less than
# MIN_STEP_S left a step is skipped.
RUNS = {
    "check": ("install", "environment", "gpu_tests", "sanitizer", "capture", "bench", "decision"),
    "extra": ("install", "environment", "profile", "fused", "suite", "transformers"),
}
DEADLINE = {"check": 540, "extra": 240}  # seconds, the summary included
SUMMARY_RESERVE_S = 10  # of a run's deadline, kept for its summary
MIN_STEP_S = 15  # a step with less time than this left is skipped, not started
NEEDS_GPU = ("gpu_tests", "sanitizer", "capture", "bench", "decision", "profile", "fused", "transformers")
PARALLEL = ("gpu_tests", "sanitizer", "capture")  # their commands run side by side

PURPOSE = {
    "install": "install the carried wheels (groupgemm cp312, oneDNN, OpenBLAS, transformers and what it imports) "
               "into a scratch prefix",
    "environment": "GPU, driver, glibc, torch and jax versions; does JAX see the GPU; the wheel's CUDA build",
    "gpu_tests": "tests/test_cuda.py (and test_cuda_build.py) in parallel pytest processes, every test on the "
                 "default kernels, the 2.x kernels, the sm90 kernels by shape and each sm90 tile",
    "sanitizer": "compute-sanitizer's memcheck, racecheck, initcheck, synccheck on the quick driver cases, "
                 "one process per tool and kernel family (and one for the expert-layer and FP8 kernels)",
    "capture": "JAX with XLA command buffers (first call inside jit, both flag settings) and torch CUDA-graph "
               "replay, side by side",
    "bench": "each GEMM per kernel at the core cells (the kernel table's evidence); forward+backward through "
             "PyTorch and JAX against torch._grouped_mm and dense; FP8 against scaled_grouped_mm",
    "decision": "the kernel table's choice per class from the measurements of the kernels that passed "
                "(hopper_kernels.def in the results)",
    "profile": "Nsight Compute at one MoE shape (bf16, G = 8, 16384 tokens, 4096 -> 14336): each GEMM's "
               "kernels and TFLOP/s against dense and torch._grouped_mm",
    "suite": "the rest of the test suite, in parallel pytest processes",
    "fused": "benchmarks/expert_mlp_fused.py: the fused expert MLP against permute + grouped MLP + unpermute, "
             "forward+backward at Qwen3-30B-A3B's expert widths in bfloat16, in PyTorch and JAX, under the default "
             "kernels and on Hopper under sm90 (its sm_90a gathered GEMM)",
    "transformers": "benchmarks/transformers_experts.py: transformers' Qwen3MoeExperts at Qwen3-30B-A3B's expert "
                    "shape in bfloat16, groupgemm against grouped_mm, batched_mm and eager, at training and decode "
                    "token counts",
}

# Each step's own limit in seconds; the run's deadline can cut it shorter.
LIMITS = {"install": 60, "environment": 45, "gpu_tests": 180, "sanitizer": 120, "capture": 60, "bench": 200,
          "decision": 20, "profile": 110, "suite": 110, "fused": 45, "transformers": 90}

SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
# initcheck needs outputs torch leaves uninitialised (a kernel reading one is reported);
# the other tools get NaN-filled outputs, so a row no kernel writes fails the value check.
SANITIZER_PREFILL = {"initcheck": "empty"}
LAYER_PART = "layer"  # the sanitizer driver's part with the expert-layer and FP8 kernels

GPU_TESTS = ("tests/test_cuda.py", "tests/test_cuda_build.py")

# The benchmark's core cells (G, tokens, hidden, ffn), for the tile sweep and the frameworks:
# fine-grained experts, 256 experts over 8 ranks, 8 wide experts; at two routings.
BENCH_CELLS = ((128, 16384, 2048, 1408), (32, 16384, 7168, 2048), (8, 16384, 4096, 14336))
BENCH_ROUTINGS = ("uniform", "skewed-some-empty")
# What the framework benchmark leaves out: the per-expert loop and ragged_dot (minutes at
# these shapes), groupgemm's dense ceiling, and each tile alone (the tile sweep times them).
BENCH_SKIP = (PER_EXPERT_LOOP, RAGGED_DOT, GROUPGEMM_DENSE,
              *map(family_contender, kernel_table.read().tile_names))
BENCH_TIMING = ("--repeats", "10", "--budget", "1", "--overhead-repeats", "200")
# fp8_bench.py's shapes, G,M,K,N (blockwise needs K and N multiples of 128).
FP8_SHAPES = ("8,16384,4096,14336", "32,16384,7168,2048", "128,16384,2048,1408")

# expert_mlp_fused.py's cells on the GPU: its two shapes at twice their CPU size (--scale 2:
# H 2048 and F 768, Qwen3-30B-A3B's expert widths, or F 256; 8192 tokens, 16 experts, top-4),
# in bfloat16, in both frameworks, under each of driver_calls.mlp_families_on(hopper); a
# quarter second of timed calls per variant and cell.
FUSED_FRAMEWORKS = ("torch", "jax")
FUSED_SHAPES = ("qwen3-30b-a3b/2", "small-F")
FUSED_DTYPE = "bfloat16"
FUSED_SCALE = 2
FUSED_TIMING = ("--repeats", "10", "--budget", "0.25")


# transformers_experts.py's cells on the GPU: Qwen3-30B-A3B's expert shape itself (--scale 1:
# hidden 2048, moe_intermediate 768, 128 experts, top-8) in bfloat16; a training step's
# tokens (the core cells' 16384, and 4096), decode steps' (its default counts). Half a second
# of timed calls per implementation and cell is meant to keep its 7 cells, imports included,
# near a minute (no GPU has run them yet); batched_mm may gather 8 GB, so it runs every
# decode cell (32 tokens gather 2.4 GB).
TRANSFORMERS_DTYPE = "bfloat16"
TRANSFORMERS_TRAIN_TOKENS = (4096, 16384)
TRANSFORMERS_DECODE_TOKENS = (1, 8, 32)
TRANSFORMERS_TIMING = ("--repeats", "10", "--decode-repeats", "30", "--budget", "0.5", "--max-gather-gb", "8")

# What a test may skip for on a GPU machine: tests that need no device (they would be
# handed host pointers), Hopper's kernels elsewhere and on Hopper the FP8 refusal other GPUs
# give (tests/test_cuda.py), the install checks' environments (./dev.sh test builds them),
# the test-only extras the machine lacks (the integrations' clients, the docs' tools:
# tests/helpers/clients.py), what needs the source build (the SASS tools). Any other skip
# leaves the step INCOMPLETE.
EXPECTED_SKIPS = ("a real device would be handed host pointers",
                  "the sm_90a kernels need a compute capability 9.0 GPU",
                  "the refusal of a GPU without FP8 tensor cores cannot run on Hopper",
                  "is not set: ./dev.sh test builds that environment",
                  "is not installed here: ./dev.sh setup installs it")


@dataclasses.dataclass
class Command:
    argv: list
    env: dict = dataclasses.field(default_factory=dict)
    label: str = ""


@dataclasses.dataclass
class Context:
    """Everything the commands depend on."""
    python: str  # the machine's own interpreter, which carries torch and jax
    repo: str
    wheels: list  # the carried wheel files
    scratch: str
    site_dir: str  # where the prefix's packages land (found after the install step)
    sanitizer: str  # path of compute-sanitizer, or "" when missing
    ncu: str  # path of Nsight Compute's ncu, or "" when missing
    out: str
    cpus: int
    hopper: bool  # the GPU runs sm_90a code: the sm90 families exist

    @property
    def prefix(self):
        return os.path.join(self.scratch, "prefix")

    @property
    def families(self):
        """The GEMM kernel families this GPU runs (the sanitizer's parts)."""
        return (kernel_table.SM80, *kernel_table.read().tile_names) if self.hopper else (kernel_table.SM80,)


def kit_script(ctx, name):
    return os.path.join(ctx.repo, "benchmarks", "gpu", name)


def python_env(ctx):
    """Environment of every step that imports groupgemm: the scratch prefix first on the
    path; JAX allocating on demand, as torch does (its default takes 75% of the GPU up
    front and leaves torch, and the other processes, too little)."""
    path = ctx.site_dir + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return {"PYTHONPATH": path, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}


def workers(ctx):
    """Parallel processes on the GPU: half the cores (each one's CPU work uses threads
    too), at least one and at most 8."""
    return max(1, min(8, ctx.cpus // 2))


def _threads(ctx):
    # Each process's CPU backend and oneDNN take their share of the cores, not all of them.
    return {"OMP_NUM_THREADS": str(max(1, ctx.cpus // workers(ctx)))}


def _pytest(ctx):
    # -rfEs: the short summary lists failures, errors and each skip with its reason.
    return [ctx.python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider"]


def commands(step, ctx):
    """The commands of one step. Those of gpu_tests, sanitizer and capture run side by
    side; those of bench one after another (they time the GPU)."""
    env = python_env(ctx)
    if step == "install":
        # --prefix, not --target: --target drops the files oneDNN's wheel installs outside
        # its package (lib/libdnnl.so.3), which groupgemm looks up through the wheel's
        # metadata. --ignore-installed: never "already satisfied" by the system.
        return [Command([ctx.python, "-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed",
                         "--no-compile", "--no-warn-script-location", "--disable-pip-version-check",
                         "--prefix", ctx.prefix, *ctx.wheels], {}, "pip")]
    if step == "environment":
        return [Command([ctx.python, kit_script(ctx, "environment_report.py")], env, "report")]
    if step == "gpu_tests":
        return [Command(_pytest(ctx) + ["-n", str(workers(ctx)), *GPU_TESTS], {**env, **_threads(ctx)}, "pytest")]
    if step == "sanitizer":
        driver = [ctx.python, kit_script(ctx, "sanitizer_driver.py"), "--quick"]
        return [Command([ctx.sanitizer or "compute-sanitizer", "--tool", tool,
                         # torch probes the runtime with calls that fail by design; the
                         # driver checks every status of the core's own calls itself.
                         "--report-api-errors", "no", "--print-limit", "20",
                         *driver, "--part", part, "--prefill", SANITIZER_PREFILL.get(tool, "nan")],
                        {**env, **_threads(ctx)}, f"{tool} {part}")
                for part in (*ctx.families, LAYER_PART) for tool in SANITIZER_TOOLS]
    if step == "capture":
        jax_check = [ctx.python, kit_script(ctx, "jax_capture_check.py")]
        dumps = os.path.join(ctx.scratch, "xla-dump")
        return [Command(jax_check + ["--command-buffers", flags, "--dump-dir", f"{dumps}-{flags}"], env,
                        f"jax {flags}") for flags in ("custom-calls", "default")] + [
            Command([ctx.python, kit_script(ctx, "capture_check.py")], env, "torch graphs")]
    if step == "bench":
        cells = [",".join(map(str, cell)) for cell in BENCH_CELLS]
        bench = [ctx.python, os.path.join(ctx.repo, "benchmarks", "bench.py"), "--device", "cuda",
                 "--dtype", "bfloat16", "--shapes", *cells, "--routing", *BENCH_ROUTINGS, *BENCH_TIMING,
                 "--skip", *BENCH_SKIP, "--out", ctx.out]
        fp8 = [ctx.python, os.path.join(ctx.repo, "benchmarks", "fp8_bench.py"), "--device", "cuda",
               "--shapes", *FP8_SHAPES]
        sweep = [ctx.python, kit_script(ctx, "tile_sweep.py"), "--out", os.path.join(ctx.out, results_dir.TILES_CSV)]
        return ([Command(sweep, env, "tile sweep")] if ctx.hopper else []) + [
            Command(bench, env, "frameworks"), Command(fp8, env, "fp8")]
    if step == "profile":
        script = [ctx.python, kit_script(ctx, "profile_shape.py")]
        ncu_csv = os.path.join(ctx.out, results_dir.NCU_CSV)
        # Speed-of-light, launch and occupancy sections of each kernel in the profiler's
        # range only (the script opens it after its warm-up), as CSV with base units; the
        # clocks as the card runs them (never locked).
        ncu = [ctx.ncu or "ncu", "--target-processes", "all", "--profile-from-start", "off", "--clock-control",
               "none", "--section", "SpeedOfLight", "--section", "LaunchStats", "--section", "Occupancy",
               "--csv", "--page", "details", "--print-units", "base", "--log-file", ncu_csv]
        return [Command(ncu + script + ["--under-ncu"], env, "ncu"),
                Command(script + ["--ncu-csv", ncu_csv, "--out", os.path.join(ctx.out, results_dir.PROFILE_MD)],
                        env, "timing")]
    if step == "suite":
        ignore = [arg for test in GPU_TESTS for arg in ("--ignore", test)]
        return [Command(_pytest(ctx) + ["-n", str(workers(ctx)), *ignore, "tests"], {**env, **_threads(ctx)},
                        "pytest")]
    if step == "fused":
        bench = [ctx.python, os.path.join(ctx.repo, "benchmarks", "expert_mlp_fused.py"), "--device", "cuda",
                 "--frameworks", *FUSED_FRAMEWORKS, "--shapes", *FUSED_SHAPES, "--dtype", FUSED_DTYPE,
                 "--scale", str(FUSED_SCALE), "--kernels", *mlp_families_on(ctx.hopper), *FUSED_TIMING,
                 "--json", os.path.join(ctx.out, results_dir.FUSED_JSON)]
        return [Command(bench, env, "fused expert MLP")]
    if step == "transformers":
        bench = [ctx.python, os.path.join(ctx.repo, "benchmarks", "transformers_experts.py"), "--device", "cuda",
                 "--scale", "1", "--dtype", TRANSFORMERS_DTYPE,
                 "--train-tokens", *map(str, TRANSFORMERS_TRAIN_TOKENS),
                 "--decode-tokens", *map(str, TRANSFORMERS_DECODE_TOKENS), *TRANSFORMERS_TIMING,
                 "--json", os.path.join(ctx.out, results_dir.TRANSFORMERS_JSON)]
        # No network there: a Hub lookup fails at once instead of waiting out the limit.
        return [Command(bench, {**env, "HF_HUB_OFFLINE": "1"}, "transformers experts")]
    if step == "decision":
        return []  # the kit decides in its own process
    raise ValueError(f"unknown step {step!r}")

