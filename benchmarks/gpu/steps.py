"""The kit's steps and the exact commands each runs, built from the run's settings. Kept
apart from running them so --dry-run prints the same commands a real run executes.
Standard library only."""

import dataclasses
import os
import sys

import results_dir

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
from contenders import PER_EXPERT_LOOP  # noqa: E402

# In run order. wheels and build are what every other step needs; they always run.
STEPS = ("wheels", "build", "environment", "pytest", "sanitizer", "capture", "bench", "profile")
PREREQUISITES = STEPS[:2]
SELECTABLE = STEPS[2:]
NEEDS_GPU = ("pytest", "sanitizer", "capture", "bench", "profile")

PURPOSE = {
    "wheels": "install the copied wheels (oneDNN, OpenBLAS, CUTLASS headers, pytest-xdist) into a scratch prefix",
    "build": "build and install groupgemm into the scratch prefix for this GPU's architecture",
    "environment": "GPU, driver, nvcc, torch and jax versions; does JAX see the GPU; is CUDA compiled in",
    "pytest": "the pytest suite in both frameworks: the GPU tests (test_cuda.py), then the other files in parallel",
    "sanitizer": "compute-sanitizer memcheck, racecheck, initcheck, synccheck over every CUDA kernel",
    "capture": "JAX with XLA command buffers (first call inside jit) and torch CUDA-graph replay",
    "bench": "bfloat16 benchmark at MoE shapes against dense, torch._grouped_mm, a loop, ragged_dot; "
             "FP8 against bfloat16 and torch's scaled_grouped_mm",
    "profile": "Nsight Compute at one MoE shape (bf16, G = 8, 16384 tokens, 4096 -> 14336): "
               "TFLOP/s against dense torch.mm, and each kernel's time and speed of light",
}

SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
# initcheck needs outputs torch leaves uninitialised (a kernel reading one is reported);
# the other tools get NaN-filled outputs, so a row no kernel writes fails the value check.
SANITIZER_PREFILL = {"initcheck": "empty"}

CUDA_TESTS = "tests/test_cuda.py"  # the GPU tests (the other files run the CPU backend)
# --quick: the GPU tests and the case-table tests (those of these files that exist).
QUICK_PYTEST = (CUDA_TESTS, "tests/test_cuda_build.py", "tests/test_core.py", "tests/test_parity.py")
# A full run: the GPU tests first, on their own, so that a run cut short by its deadline
# has done them; then every other file in parallel (pytest-xdist, from the wheels
# folder; measured on a 2-core machine, those files took 227 s serially and 157 s with
# -n 2). The GPU tests may take three quarters of the step's time (this share against
# the other files' 1), the other files what is left.
GPU_TESTS_SHARE = 3.0
GRAPH_TESTS = (CUDA_TESTS, "-k", "graph")  # test_cuda.py's CUDA-graph replay test

# One bench.py run per expert shape (its flags sweep a product; real models are points),
# optionally for some frameworks and without some contenders: jax.lax.ragged_dot does G
# times the work (minutes at the wide shapes) and XLA takes minutes to compile a JAX loop
# over 128 experts, so those are left out where they would not fit the step's time.
QUICK_SWEEP = ({"experts": (8, 32), "tokens": (4096,), "hidden": (2048,), "ffn": (1408,)},)
FULL_SWEEP = QUICK_SWEEP + (
    # fine-grained experts
    {"experts": (128,), "tokens": (16384,), "hidden": (2048,), "ffn": (1408,), "frameworks": ("torch",)},
    {"experts": (128,), "tokens": (16384,), "hidden": (2048,), "ffn": (1408,), "frameworks": ("jax",),
     "skip": (PER_EXPERT_LOOP,)},
    # 256 experts over 8 ranks; 8 wide experts
    {"experts": (32,), "tokens": (16384,), "hidden": (7168,), "ffn": (2048,), "frameworks": ("torch",)},
    {"experts": (8,), "tokens": (16384,), "hidden": (4096,), "ffn": (14336,), "frameworks": ("torch",)},
)
# fp8_bench.py's expert shapes, G,M,K,N (FP8 blockwise needs K and N multiples of 128).
FP8_QUICK_SHAPES = ("8,4096,2048,1408",)
FP8_SHAPES = FP8_QUICK_SHAPES + ("32,16384,7168,2048", "128,16384,2048,1408")
# The even split and realistic traffic (a quarter of the experts empty, the rest skewed).
BENCH_ROUTINGS = ("--routing", "uniform", "skewed-some-empty")
BENCH_TIMING = ("--repeats", "5", "--budget", "2")

# Seconds each step may take at most, (quick, full); a run's deadline can cut them shorter.
TIMEOUTS = {
    "wheels": (180, 180),
    "build": (420, 600),
    "environment": (120, 120),
    "pytest": (240, 1500),
    "sanitizer": (240, 900),
    "capture": (150, 300),
    "bench": (120, 560),
    "profile": (240, 300),
}
# Whole-run deadlines: every step's limit is cut to what is left, so a run ends at its
# deadline plus at most half a minute (a killed command's grace, the benchmark's merge):
# --quick within 8 minutes, a full run within 10 minutes, summary included (the steps it
# had no time for are run by a second ./dev.sh gpu with --steps).
DEADLINE = {True: 450, False: 550}
MERGE_RESERVE_S = 30  # of the bench step's time, kept for merging its parts


@dataclasses.dataclass
class Command:
    argv: list
    env: dict = dataclasses.field(default_factory=dict)
    label: str = ""
    share: float = 1.0  # of the step's time left, against the shares of the commands after it


@dataclasses.dataclass
class Context:
    """Everything the commands depend on."""
    python: str  # the machine's own interpreter, which carries torch and jax
    repo: str
    wheels: list  # wheel files to install
    scratch: str
    site_dir: str  # where the prefix's packages land (found after the wheels step)
    arch: str  # CMAKE_CUDA_ARCHITECTURES
    sanitizer: str  # path of compute-sanitizer, or "" when missing
    ncu: str  # path of Nsight Compute's ncu, or "" when missing
    out: str
    quick: bool

    @property
    def prefix(self):
        return os.path.join(self.scratch, "prefix")


def kit_script(ctx, name):
    return os.path.join(ctx.repo, "benchmarks", "gpu", name)


def python_env(ctx):
    """Environment of every step that imports groupgemm: the scratch prefix first on the
    path; JAX allocating on demand, as torch does (its default takes 75% of the GPU up
    front and leaves torch too little in the same process)."""
    path = ctx.site_dir + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return {"PYTHONPATH": path, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def _pip_install(ctx):
    # --prefix, not --target: --target drops the files oneDNN's wheel installs outside
    # its package (lib/libdnnl.so.3, include/), which CMake and groupgemm look up through
    # the wheel's metadata. --ignore-installed: never "already satisfied" by the system.
    return [ctx.python, "-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed",
            "--no-warn-script-location", "--disable-pip-version-check", "--prefix", ctx.prefix]


def _bench_commands(ctx):
    commands = []
    sweep = QUICK_SWEEP if ctx.quick else FULL_SWEEP
    for i, shape in enumerate(sweep):
        argv = [ctx.python, os.path.join(ctx.repo, "benchmarks", "bench.py"), "--device", "cuda",
                "--dtype", "bfloat16", *BENCH_TIMING, *BENCH_ROUTINGS, "--overhead-repeats", "500" if i == 0 else "50"]
        for flag in ("experts", "tokens", "hidden", "ffn", "frameworks", "skip"):
            if flag in shape:
                argv += [f"--{flag}", *map(str, shape[flag])]
        argv += ["--out", bench_part_dir(ctx, i)]
        label = f"G={','.join(map(str, shape['experts']))} K={shape['hidden'][0]} N={shape['ffn'][0]}"
        if "frameworks" in shape:
            label += " " + ",".join(shape["frameworks"])
        commands.append(Command(argv, python_env(ctx), label))
    # The FP8 GEMMs against the bfloat16 ones and torch's scaled_grouped_mm (tables in the log).
    fp8 = [ctx.python, os.path.join(ctx.repo, "benchmarks", "fp8_bench.py"), "--device", "cuda",
           "--shapes", *(FP8_QUICK_SHAPES if ctx.quick else FP8_SHAPES)]
    commands.append(Command(fp8, python_env(ctx), "fp8"))
    parts = [bench_part_dir(ctx, i) for i in range(len(sweep))]
    commands.append(Command([ctx.python, kit_script(ctx, "bench_merge.py"), "--out", ctx.out, *parts],
                            python_env(ctx), "merge"))
    return commands


def pytest_workers(cpus=None):
    """Processes for the other tests: half the cores (each one's CPU GEMMs use threads
    too), at least one and at most 8."""
    return max(1, min(8, (cpus or os.cpu_count() or 2) // 2))


# What a test may skip for on a GPU machine: tests that need no device (they would be
# handed host pointers), Hopper's kernels elsewhere and on Hopper the FP8 refusal other GPUs
# give (tests/test_cuda.py), the install checks' environments (./dev.sh test builds them),
# the test-only extras the wheels folder leaves out (the integrations' clients, the docs'
# tools: tests/helpers/clients.py). Any other skip leaves the pytest step INCOMPLETE.
EXPECTED_SKIPS = ("a real device would be handed host pointers",
                  "the sm_90a kernels need a compute capability 9.0 GPU",
                  "the refusal of a GPU without FP8 tensor cores cannot run on Hopper",
                  "is not set: ./dev.sh test builds that environment",
                  "is not installed here: ./dev.sh setup installs it")


def _pytest(ctx):
    # -rfEs: the short summary lists failures, errors and each skip with its reason.
    return [ctx.python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider"]


def bench_part_dir(ctx, index):
    return os.path.join(ctx.scratch, "bench", f"part{index}")


def commands(step, ctx):
    """The commands of one step, in order."""
    env = python_env(ctx)
    if step == "wheels":
        return [Command(_pip_install(ctx) + list(ctx.wheels), {}, "install")]
    if step == "build":
        argv = _pip_install(ctx) + ["--no-build-isolation", "-C", f"cmake.define.CMAKE_CUDA_ARCHITECTURES={ctx.arch}",
                                    "-C", f"build-dir={os.path.join(ctx.scratch, 'build')}", ctx.repo]
        return [Command(argv, env, "build")]
    if step == "environment":
        return [Command([ctx.python, kit_script(ctx, "environment_report.py")], env, "report")]
    if step == "pytest":
        pytest = _pytest(ctx)
        if ctx.quick:
            return [Command(pytest + [t for t in QUICK_PYTEST if os.path.exists(os.path.join(ctx.repo, t))], env,
                            "pytest")]
        cpus, workers = os.cpu_count() or 2, pytest_workers()
        # Each worker's CPU backend and oneDNN take their share of the cores, not all of them.
        threads = {"OMP_NUM_THREADS": str(max(1, cpus // workers))}
        return [Command(pytest + [CUDA_TESTS], env, "GPU tests", share=GPU_TESTS_SHARE),
                Command(pytest + ["-n", str(workers), "--ignore", CUDA_TESTS, "tests"], {**env, **threads},
                        "other tests")]
    if step == "sanitizer":
        driver = [ctx.python, kit_script(ctx, "sanitizer_driver.py")] + (["--quick"] if ctx.quick else [])
        return [Command([ctx.sanitizer or "compute-sanitizer", "--tool", tool,
                         # torch probes the runtime with calls that fail by design; the
                         # driver checks every status of the core's own calls itself.
                         "--report-api-errors", "no", "--print-limit", "20",
                         *driver, "--prefill", SANITIZER_PREFILL.get(tool, "nan")], env, tool)
                for tool in SANITIZER_TOOLS]
    if step == "capture":
        dumps = os.path.join(ctx.scratch, "xla-dump")
        jax_check = [ctx.python, kit_script(ctx, "jax_capture_check.py")]
        return [
            Command(jax_check + ["--command-buffers", "custom-calls", "--dump-dir", dumps + "-custom-calls"],
                    env, "jax command buffers"),
            Command(jax_check + ["--command-buffers", "default", "--dump-dir", dumps + "-default"], env, "jax default"),
            Command([ctx.python, kit_script(ctx, "capture_check.py")], env, "torch graphs"),
            Command(_pytest(ctx) + list(GRAPH_TESTS), env, "graph test"),
        ]
    if step == "bench":
        return _bench_commands(ctx)
    if step == "profile":
        script = [ctx.python, kit_script(ctx, "profile_shape.py")]
        ncu_csv = os.path.join(ctx.out, results_dir.NCU_CSV)
        # Speed-of-light, launch and occupancy sections of each kernel in the profiler's
        # range only (the script opens it after its warm-up), as CSV with base units.
        ncu = [ctx.ncu or "ncu", "--target-processes", "all", "--profile-from-start", "off",
               "--section", "SpeedOfLight", "--section", "LaunchStats", "--section", "Occupancy",
               "--csv", "--page", "details", "--print-units", "base", "--log-file", ncu_csv]
        return [Command(ncu + script + ["--under-ncu"], env, "ncu"),
                Command(script + ["--ncu-csv", ncu_csv, "--out", os.path.join(ctx.out, results_dir.PROFILE_MD)],
                        env, "timing")]
    raise ValueError(f"unknown step {step!r}")


def timeout(step, quick):
    return TIMEOUTS[step][0 if quick else 1]
