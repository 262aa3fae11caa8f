"""The GPU kit (benchmarks/gpu/) on a machine without a GPU: its command line, how it
reads pytest's and compute-sanitizer's output, its summary and results folder, its plan,
a whole run against canned command output, the profile's reading of Nsight Compute's CSV,
and the sanitizer driver's calls and checks on the CPU backend. The kit itself only does
its real work where there is a GPU."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
KIT_DIR = os.path.join(ROOT, "benchmarks", "gpu")

import driver_calls  # noqa: E402
import hlo_command_buffers  # noqa: E402
import kit  # noqa: E402
import machine  # noqa: E402
import profile_shape  # noqa: E402
import results_dir  # noqa: E402
import runner  # noqa: E402
import steps  # noqa: E402
import verdicts  # noqa: E402
import wheels  # noqa: E402
from verdicts import FAIL, INCOMPLETE, PASS, SKIP, Verdict  # noqa: E402

KIT = os.path.join(KIT_DIR, "kit.py")


def run_kit(*args):
    return subprocess.run([sys.executable, KIT, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


# ---- command line ---------------------------------------------------------------------

def test_defaults_point_into_the_repository_and_run_every_step():
    args = kit.parse_args([])
    repo = os.path.normpath(ROOT)
    assert args.wheels == os.path.join(repo, ".gpu-wheels")
    assert args.out == os.path.join(repo, "benchmarks", "results", "gpu")
    assert args.scratch == os.path.join(repo, "build", "gpu-kit")
    assert not args.quick and not args.dry_run
    assert args.steps == ["environment", "pytest", "sanitizer", "capture", "bench", "profile"]
    assert args.deadline == 550  # a full run ends within a 10-minute command


def test_quick_has_the_eight_minute_deadline_and_flags_are_taken(tmp_path):
    args = kit.parse_args(["--quick", "--out", str(tmp_path / "o"), "--wheels", str(tmp_path / "w"),
                           "--steps", "capture", "bench", "--arch", "80"])
    assert args.quick and args.deadline + 30 <= 8 * 60
    assert args.out == str(tmp_path / "o") and args.wheels == str(tmp_path / "w")
    assert kit.parse_args(["--out", "here"]).out == os.path.abspath("here")  # given: relative to the caller
    assert args.steps == ["capture", "bench"] and args.arch == "80"
    assert kit.parse_args(["--quick", "--deadline", "0"]).deadline == 0


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--steps", "wheels"], "invalid choice: 'wheels'"),
    (["--deadline", "-5"], "--deadline must be 0 or more seconds"),
    (["--deadline", "soon"], "invalid float value"),
    (["--out"], "expected one argument"),
])
def test_bad_flags_exit_non_zero_with_a_message(argv, message):
    proc = run_kit(*argv)
    assert proc.returncode == 2
    assert message in proc.stderr and "usage: ./dev.sh gpu" in proc.stderr


# ---- reading the tools' output ----------------------------------------------------------

@pytest.mark.parametrize("text, counts", [
    ("12 passed, 3 skipped in 4.2s", {"passed": 12, "skipped": 3}),
    ("..F\n==== 1 failed, 10 passed, 2 errors in 3s ====", {"failed": 1, "passed": 10, "errors": 2}),
    ("= 1 passed, 1 warning, 1 error in 62.01s (0:01:02) =", {"passed": 1, "warnings": 1, "errors": 1}),
    ("3 passed, 1 deselected, 2 xfailed in 0.10s", {"passed": 3, "deselected": 1, "xfailed": 2}),
    ("no tests ran in 0.01s", {}),
    ("collecting ...\nKilled", None),
    ("", None),
])
def test_pytest_closing_line_is_parsed(text, counts):
    assert verdicts.parse_pytest_summary(text) == counts


EXPECTED_SKIP_SUMMARY = ("==== short test summary info ====\n"
                         "SKIPPED [2] tests/test_core_moe_ops.py:436: a real device would be handed host pointers\n"
                         "SKIPPED [1] tests/test_install.py:57: TORCH_ENV is not set: ./dev.sh test builds that "
                         "environment\n")


def test_pytest_verdicts():
    assert verdicts.pytest_verdict(EXPECTED_SKIP_SUMMARY + "12 passed, 3 skipped in 4.2s", 0, steps.EXPECTED_SKIPS) == (
        PASS, "12 passed, 3 skipped")
    assert verdicts.pytest_verdict("1 failed, 10 passed, 2 errors in 3s", 1) == (
        FAIL, "10 passed, 1 failed, 2 errors")
    assert verdicts.pytest_verdict("10 passed, 2 errors in 3s", 1) == (FAIL, "10 passed, 2 errors")
    assert verdicts.pytest_verdict("4 skipped in 1s", 0)[0] == FAIL  # nothing passed: nothing proven
    assert verdicts.pytest_verdict("no tests ran in 0.01s", 5)[0] == FAIL
    assert verdicts.pytest_verdict("3 passed in 1s", 3)[0] == FAIL  # a crash after the closing line
    assert verdicts.pytest_verdict("....\n", -9) == (FAIL, "no pytest summary line (exit -9)")
    failed = ("----- Captured stdout call -----\nFAILED tests/inner.py::test_z - printed by a test\n"
              "=========================== short test summary info ============================\n"
              "FAILED tests/test_cuda.py::test_a[sm90_64x128-a b] - AssertionError: 3 != 4\n"
              "ERROR tests/test_cuda.py::test_b - RuntimeError\n1 failed, 9 passed, 1 error in 3.0s\n")
    assert verdicts.pytest_verdict(failed, 1) == (
        FAIL, "9 passed, 1 failed, 1 errors; first: tests/test_cuda.py::test_a[sm90_64x128-a b]")


def test_sanitizer_error_summary_decides():
    clean = "RESULT: PASS 402 calls\n========= ERROR SUMMARY: 0 errors\n"
    dirty = "========= Invalid __global__ read\n========= ERROR SUMMARY: 3 errors\n"
    assert verdicts.sanitizer_errors(clean) == 0 and verdicts.sanitizer_errors(dirty) == 3
    assert verdicts.sanitizer_errors("========= ERROR SUMMARY: 1 error") == 1
    assert verdicts.sanitizer_errors("the driver crashed") is None
    races = "========= RACECHECK SUMMARY: 2 hazards displayed ({} errors, {} warnings)\n"
    assert verdicts.sanitizer_errors(races.format(0, 2)) == 0 and verdicts.sanitizer_errors(races.format(1, 1)) == 1
    assert verdicts.sanitizer_tool_verdict("racecheck", races.format(0, 2), 0) == (
        PASS, "racecheck: 0 errors, 2 race warnings")
    assert verdicts.sanitizer_tool_verdict("racecheck", races.format(2, 0) + clean, 0)[0] == FAIL
    assert verdicts.sanitizer_tool_verdict("memcheck", clean, 0) == (PASS, "memcheck: 0 errors")
    assert verdicts.sanitizer_tool_verdict("racecheck", dirty, 0) == (FAIL, "racecheck: 3 errors")
    assert verdicts.sanitizer_tool_verdict("initcheck", "Segmentation fault", -11)[0] == FAIL
    wrong_values = "RESULT: FAIL 2 of 9 calls wrong\n========= ERROR SUMMARY: 0 errors\n"
    assert verdicts.sanitizer_tool_verdict("synccheck", wrong_values, 1) == (
        FAIL, "synccheck: 0 errors, driver exited 1 (2 of 9 calls wrong)")


def test_check_scripts_are_judged_by_their_result_line_and_exit_status():
    assert verdicts.script_verdict("torch graphs", "x\nRESULT: PASS all replayed\n", 0) == (
        PASS, "torch graphs: all replayed")
    assert verdicts.script_verdict("t", "RESULT: PASS fine\nSegmentation fault\n", -11)[0] == FAIL
    assert verdicts.script_verdict("t", "RESULT: SKIP no CUDA GPU\n", 3) == (SKIP, "t: no CUDA GPU")
    assert verdicts.script_verdict("t", "Traceback ...\n", 1) == (FAIL, "t: no RESULT line (exit 1)")
    assert verdicts.combine([(PASS, "a"), (PASS, "b")]) == (PASS, "a; b")
    # A planted fault: three of the sanitizer's four tools out of time; PASS would claim them.
    sanitizer = [(PASS, "memcheck: 0 errors")] + [(SKIP, f"{t}: out of time") for t in steps.SANITIZER_TOOLS[1:]]
    assert verdicts.combine(sanitizer) == (INCOMPLETE, "memcheck: 0 errors; racecheck: out of time; "
                                                       "initcheck: out of time; synccheck: out of time")
    assert verdicts.combine([(PASS, "a"), (INCOMPLETE, "b")])[0] == INCOMPLETE
    assert verdicts.combine([(INCOMPLETE, "a"), (FAIL, "b")])[0] == FAIL
    assert verdicts.combine([(PASS, "a"), (FAIL, "b")])[0] == FAIL
    assert verdicts.combine([(SKIP, "a")])[0] == SKIP


def test_an_unexpected_skip_makes_the_pytest_step_incomplete(tmp_path):
    # Planted faults: a GPU test skipped on the GPU machine; skips without their reasons.
    unexpected = EXPECTED_SKIP_SUMMARY + "SKIPPED [4] tests/test_cuda.py:115: needs a CUDA GPU, torch with CUDA\n"
    assert verdicts.pytest_verdict(unexpected + "12 passed, 7 skipped in 4.2s", 0, steps.EXPECTED_SKIPS) == (
        INCOMPLETE, "12 passed, 7 skipped; 4 unexpected skips, first: tests/test_cuda.py:115: needs a CUDA GPU, "
                    "torch with CUDA")
    assert verdicts.pytest_verdict("12 passed, 3 skipped in 4.2s", 0, steps.EXPECTED_SKIPS) == (
        INCOMPLETE, "12 passed, 3 skipped; 3 unexpected skips, first: not listed (run pytest with -rs)")
    ctx = kit.context(kit.parse_args(["--out", str(tmp_path)]), gpu_facts(tmp_path))
    assert all("-rfEs" in command.argv for command in steps.commands("pytest", ctx))


def test_summary_table_has_one_row_per_step_in_order():
    table = verdicts.render_table([Verdict("build", PASS, "built for 90a", 61.4),
                                   Verdict("pytest", FAIL, "1 failed | 3 passed", 120.0, earlier=True)])
    lines = table.splitlines()
    assert lines[0] == "| step | verdict | seconds | details |" and len(lines) == 4
    assert lines[2] == "| build | PASS | 61 | built for 90a |"
    assert lines[3] == "| pytest | FAIL | 120 | 1 failed \\| 3 passed (earlier run) |"


def test_command_buffer_placement_is_read_from_optimized_hlo(tmp_path):
    hlo = "\n".join([
        "HloModule jit_loss",
        "%command_buffer (p: bf16[96,64], p.1: s32[4]) -> (bf16[96,32], u8[240]) {",
        '  %cc = (bf16[96,32]{1,0}, u8[240]{0}) custom-call(%p, %p.1), custom_call_target="groupgemm_matmul"',
        "}",
        "ENTRY %main.2 (a: bf16[96,64]) -> bf16[96,32] {",
        '  %cc.1 = (f32[2,64,32]{2,1,0}, u8[240]{0}) custom-call(%a), custom_call_target="groupgemm_wgrad"',
        '  %other = f32[2] custom-call(%a), custom_call_target="__cublas$gemm"',
        "}",
    ])
    calls = hlo_command_buffers.custom_calls(hlo)
    assert calls == [("command_buffer", "groupgemm_matmul"), ("main.2", "groupgemm_wgrad")]
    assert hlo_command_buffers.in_command_buffers(calls) == 1
    (tmp_path / "module_0001.jit_loss.sm_9.0_gpu_after_optimizations.txt").write_text(hlo)
    (tmp_path / "module_0002.jit_loss.cpu_after_optimizations.txt").write_text(hlo)  # CPU: never captured
    assert hlo_command_buffers.scan_dump(str(tmp_path)) == (1, 2)


def test_xla_compiles_are_counted_per_function_and_platform_from_the_dump(tmp_path):
    for name in ("module_0000.jit_loss.cpu_after_optimizations.txt",
                 "module_0000.jit_loss.cpu_after_optimizations-buffer-assignment.txt",  # not a compile
                 "module_0002.jit_accumulate.cpu_after_optimizations.txt",
                 "module_2648.jit_loss.sm_9.0a_gpu_after_optimizations.txt",
                 "module_4635.jit_accumulate.sm_9.0a_gpu_after_optimizations.txt",
                 "module_4700.jit_accumulate.sm_9.0a_gpu_after_optimizations.txt",  # a recompile
                 "module_0001.jit_loss.sm_9.0a_gpu_before_optimizations.txt"):
        (tmp_path / name).write_text("HloModule m\n")
    assert hlo_command_buffers.xla_compiles(str(tmp_path)) == {
        ("jit_loss", "cpu"): 1, ("jit_accumulate", "cpu"): 1, ("jit_loss", "gpu"): 1, ("jit_accumulate", "gpu"): 2}


def test_jax_capture_check_needs_calls_recorded_inside_the_command_buffer():
    import jax_capture_check

    captured = {"calls": 12, "calls_under_capture": 12, "first_under_capture": True}
    assert jax_capture_check.capture_evidence(captured, required=True)[0] is None
    # Planted faults: every call ran outside any capture; the first call did.
    outside = {"calls": 12, "calls_under_capture": 0, "first_under_capture": False}
    assert "no groupgemm call ran inside a command buffer" in jax_capture_check.capture_evidence(outside, True)[0]
    first_outside = {"calls": 12, "calls_under_capture": 11, "first_under_capture": False}
    assert "first groupgemm call ran outside" in jax_capture_check.capture_evidence(first_outside, True)[0]
    # XLA's default settings, or the CPU rehearsal: reported, not required.
    missing, seen = jax_capture_check.capture_evidence(outside, required=False)
    assert missing is None and seen.startswith("0 of 12 groupgemm CUDA calls")


def test_jax_capture_check_rehearses_on_the_cpu(tmp_path):
    # The GPU check's own logic (routings, reference, exact zeros, XLA compiles per
    # function from the dump) with the CPU backend on both sides.
    script = os.path.join(KIT_DIR, "jax_capture_check.py")
    run = subprocess.run([sys.executable, script, "--device", "cpu", "--dump-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "RESULT: PASS" in run.stdout, run.stdout + run.stderr
    assert hlo_command_buffers.xla_compiles(str(tmp_path))[("jit_accumulate", "cpu")] == 1


# ---- machine, wheels, results folder ----------------------------------------------------

def test_compute_capability_becomes_the_cmake_architecture():
    assert machine.cuda_architecture("9.0") == "90a"  # H100, H200
    assert machine.cuda_architecture("8.0") == "80" and machine.cuda_architecture(" 8.6") == "86"
    assert machine.cuda_architecture("10.0") == "100"
    with pytest.raises(ValueError):
        machine.cuda_architecture("[N/A]")
    assert machine.architecture_for([], sys.executable) == "80;90a"  # no GPU: what CMakeLists.txt builds
    assert machine.architecture_for([("H100", "580.65", "9.0")], sys.executable) == "90a"
    # nvidia-smi without the capability: torch is asked, and where torch sees no GPU, the default
    assert machine.architecture_for([("GPU", "470.1", "[N/A]")], sys.executable) == "80;90a"


def test_required_wheels_are_found_by_name_and_version(tmp_path):
    for name in ("onednn_cpu_gomp-2023.2.0-py2.py3-none-manylinux1_x86_64.whl",
                 "nvidia_cutlass-4.2.0.0-py3-none-any.whl", "nvidia_cutlass-4.1.0.0-py3-none-any.whl",
                 "scipy_openblas32-0.3.30.0-py3-none-manylinux_2_28_x86_64.whl",
                 "pytest_xdist-3.8.0-py3-none-any.whl", "execnet-2.1.2-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    found, missing = wheels.find_wheels(str(tmp_path))
    assert set(found) == {"onednn-cpu-gomp", "nvidia-cutlass", "pytest-xdist", "execnet"}
    assert os.path.basename(found["nvidia-cutlass"]) == "nvidia_cutlass-4.2.0.0-py3-none-any.whl"
    assert missing == ["onednn-devel-cpu-gomp==2023.2.0", "scipy-openblas32==0.3.34.481.3"]
    assert wheels.find_wheels(str(tmp_path / "absent"))[0] == {}


def test_wheels_are_downloaded_for_the_gpu_machines_python():
    command = wheels.download_command("nvidia-cutlass", "4.2.0.0", "DEST", python="python3")
    assert command[:4] == ["python3", "-m", "pip", "download"]
    for flag in ("--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"):
        assert flag in command
    assert command[-3:] == ["-d", "DEST", "nvidia-cutlass==4.2.0.0"]


def test_results_folder_budget(tmp_path):
    for i in range(8):
        (tmp_path / f"f{i}").write_text("x")
    assert results_dir.budget_problems(str(tmp_path)) == []
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "deep_enough").write_text("x")
    problems = results_dir.budget_problems(str(tmp_path))
    assert problems == [f"9 files in {tmp_path}, at most 8"]
    (tmp_path / "a" / "b" / "c").mkdir()
    (tmp_path / "a" / "b" / "c" / "too_deep").write_text("x")
    assert any("too_deep is 3 folders deep" in p for p in results_dir.budget_problems(str(tmp_path)))
    assert len(results_dir.KIT_FILES) <= results_dir.MAX_FILES


def test_site_dir_is_found_wherever_pip_put_it(tmp_path):
    site = tmp_path / "local" / "lib" / "python3.12" / "dist-packages"
    (site / "onednn_cpu_gomp-2023.2.0.dist-info").mkdir(parents=True)
    assert kit.find_site_dir(str(tmp_path)) == str(site)
    guess = kit.find_site_dir(str(tmp_path / "empty"))
    assert guess.endswith(os.path.join("lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages"))


# ---- the plan ---------------------------------------------------------------------------

def gpu_facts(tmp_path, sanitizer="/usr/local/cuda/bin/compute-sanitizer", ncu="/usr/local/cuda/bin/ncu"):
    found = {name: str(tmp_path / f"{name}.whl") for name, _ in wheels.REQUIRED}
    return kit.Facts([("NVIDIA H100 80GB HBM3", "580.65", "9.0")], "90a", sanitizer, found, [], "python3.12", ncu)


def test_dev_sh_dry_run_prints_the_plan_and_exits_0(tmp_path):
    proc = subprocess.run([os.path.join(ROOT, "dev.sh"), "gpu", "--dry-run", "--wheels", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "plan only (--dry-run)" in out
    for name in steps.STEPS:
        assert f"{name}: {steps.PURPOSE[name]}" in out
    assert out.count("MISSING") == len(wheels.REQUIRED)  # an empty wheels folder
    assert "compute-sanitizer:" in out and "pip install" in out
    assert not os.path.exists(os.path.join(str(tmp_path), "prefix"))  # nothing was installed


def test_plan_with_a_gpu_has_every_command(tmp_path):
    args = kit.parse_args(["--wheels", str(tmp_path), "--scratch", str(tmp_path / "s"), "--out", str(tmp_path / "o")])
    plan = kit.plan_text(args, gpu_facts(tmp_path))
    assert "SKIPPED" not in plan and "no GPU" not in plan
    assert "CMAKE_CUDA_ARCHITECTURES=90a" in plan and "--no-build-isolation" in plan
    assert f"--prefix {tmp_path / 's' / 'prefix'}" in plan
    for tool in steps.SANITIZER_TOOLS:
        assert f"--tool {tool}" in plan
    # The GPU tests first on their own, then the other files in parallel.
    gpu_tests, other_tests = plan.index("-m pytest -q -rfEs -p no:cacheprovider tests/test_cuda.py\n"), plan.index(
        f"-m pytest -q -rfEs -p no:cacheprovider -n {steps.pytest_workers()} --ignore tests/test_cuda.py tests\n")
    assert gpu_tests < other_tests
    threads = (os.cpu_count() or 2) // steps.pytest_workers()  # the workers share the cores
    assert f"OMP_NUM_THREADS={threads} " in plan[gpu_tests:other_tests]
    assert plan.count("benchmarks/bench.py --device cuda --dtype bfloat16") == len(steps.FULL_SWEEP)
    # Where ragged_dot or a compiled 128-expert JAX loop would take minutes, they are left out.
    assert plan.count("--experts 128 --tokens 16384 --hidden 2048 --ffn 1408 --frameworks jax "
                      "--skip 'per-expert loop'") == 1
    assert plan.count("--frameworks torch --out") == 3
    assert "--experts 8 32 --tokens 4096 --hidden 2048 --ffn 1408 --out" in plan  # both frameworks, every contender
    assert "jax_capture_check.py --command-buffers custom-calls" in plan and "capture_check.py" in plan
    out = tmp_path / "o"
    assert "bin/ncu --target-processes all --profile-from-start off --section SpeedOfLight" in plan
    assert f"--log-file {out / 'ncu.csv'} python3.12 " in plan and "profile_shape.py --under-ncu\n" in plan
    assert f"profile_shape.py --ncu-csv {out / 'ncu.csv'} --out {out / 'profile.md'}" in plan


def test_plan_says_what_would_be_skipped_and_why(tmp_path):
    args = kit.parse_args(["--quick", "--wheels", str(tmp_path), "--steps", "sanitizer"])
    facts = gpu_facts(tmp_path, sanitizer="", ncu="")
    facts.gpus = []
    plan = kit.plan_text(args, facts)
    assert "no GPU: steps 2-6 (pytest, sanitizer, capture, bench, profile) would be skipped" in plan
    assert "would be SKIPPED: not selected (--steps); no CUDA GPU (nvidia-smi found none); ncu not found" in plan
    assert "would be SKIPPED: no CUDA GPU (nvidia-smi found none); compute-sanitizer not found" in plan
    assert "would be SKIPPED: not selected (--steps)" in plan
    assert "sanitizer_driver.py --quick" in plan
    assert plan.count("benchmarks/bench.py") == 0  # unselected steps show no commands


# ---- a whole run, against canned output ---------------------------------------------------

CANNED = {
    "pytest": "....\n" + EXPECTED_SKIP_SUMMARY + "120 passed, 3 skipped in 95.1s\n",
    "compute-sanitizer": "RESULT: PASS 402 calls match\n========= ERROR SUMMARY: 0 errors\n",
    "bench.py": "wrote bench.csv\n",
    "fp8_bench.py": "RESULT: PASS 2 shapes and routings\n",
    "bench_merge.py": "RESULT: PASS 2 configurations; torch fwd+bwd 500-600 TFLOP/s\n",
    "environment_report.py": "RESULT: PASS NVIDIA H100, driver 580.65\n",
    "jax_capture_check.py": "RESULT: PASS 6 routings match\n",
    "capture_check.py": "RESULT: PASS replayed\n",
    "ncu": "RESULT: PASS ran 9 contenders under the profiler\n",
    "profile_shape.py": "RESULT: PASS forward 0.85x dense, dgrad 0.84x dense, wgrad 0.80x dense\n",
    "pip": "Successfully installed\n",
}


def fake_runner(failing=()):
    seen = []

    def run(command, log, timeout, env_changes=None, cwd=None):
        seen.append(command)
        line = " ".join(command)
        key = next(k for k in CANNED if (k == "pytest" and "pytest" in command) or
                   (k != "pytest" and any(os.path.basename(part) == k or part == k for part in command)))
        text = CANNED[key]
        if any(f in line for f in failing):
            text = "...F\n1 failed, 119 passed in 90s\n" if key == "pytest" else "boom\n"
        log.write(text)
        return runner.Completed(0 if text == CANNED[key] else 1, text, 1.0, False)

    return run, seen


def test_a_whole_run_continues_past_failures_and_writes_its_summary(tmp_path, monkeypatch, capsys):
    run, seen = fake_runner(failing=["tests/test_core.py"])  # only in --quick's pytest command
    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(kit, "detect", lambda args: gpu_facts(tmp_path))
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    code = kit.main(["--quick", "--out", str(out), "--scratch", str(scratch), "--deadline", "0"])
    assert code == 1  # pytest failed
    table = capsys.readouterr().out
    assert "| pytest | FAIL |" in table and "1 failed" in table
    for name in ("wheels", "build", "environment", "sanitizer", "capture", "bench", "profile"):
        assert f"| {name} | PASS |" in table, name  # the steps after the failure still ran
    assert sum("compute-sanitizer" in c[0] for c in seen) == 4
    assert "ncu: ran 9 contenders under the profiler" in table and "timing: forward 0.85x dense" in table
    assert sorted(os.listdir(out)) == ["kit.log", "summary.json", "summary.md"]
    assert results_dir.budget_problems(str(out)) == []
    assert "| sanitizer | PASS |" in (out / "summary.md").read_text()

    # A second run of one step keeps the other verdicts, marked as earlier.
    run, seen = fake_runner()
    monkeypatch.setattr(runner, "run", run)
    code = kit.main(["--quick", "--out", str(out), "--scratch", str(scratch), "--deadline", "0", "--steps", "pytest"])
    assert code == 0
    table = (out / "summary.md").read_text()
    assert "| pytest | PASS |" in table and "| bench | PASS |" in table
    assert table.count("(earlier run)") == 5  # environment, sanitizer, capture, bench, profile


def test_a_failed_build_skips_what_needs_it(tmp_path, monkeypatch):
    run, _ = fake_runner(failing=["--no-build-isolation"])
    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(kit, "detect", lambda args: gpu_facts(tmp_path))
    args = kit.parse_args(["--out", str(tmp_path / "o"), "--scratch", str(tmp_path / "s"), "--deadline", "0"])
    with open(tmp_path / "log", "w") as log:
        result = {v.step: v for v in kit.run_all(args, gpu_facts(tmp_path), log)}
    assert result["build"].status == FAIL and result["wheels"].status == PASS
    assert all(result[name].status == SKIP and result[name].reason == "the build failed"
               for name in steps.SELECTABLE)


def test_a_step_past_the_deadline_is_skipped_with_how_to_finish(tmp_path, monkeypatch):
    run, _ = fake_runner()
    monkeypatch.setattr(runner, "run", run)
    args = kit.parse_args(["--out", str(tmp_path / "o"), "--scratch", str(tmp_path / "s"), "--deadline", "5"])
    with open(tmp_path / "log", "w") as log:
        result = {v.step: v for v in kit.run_all(args, gpu_facts(tmp_path), log)}
    assert result["wheels"].status == SKIP and "out of time: run again with --steps wheels" in result["wheels"].reason
    assert result["environment"].reason == "nothing was built"


def test_a_failed_build_is_summed_up_by_its_compiler_error():
    output = ("ninja: build stopped\n/src/gemm_bf16.cu(12): error: identifier \"X\" is undefined\n"
              "error: subprocess-exited-with-error\nERROR: Failed building wheel for groupgemm\n")
    assert kit.last_error_line(output) == '/src/gemm_bf16.cu(12): error: identifier "X" is undefined'
    missing = "ModuleNotFoundError: No module named 'x'"
    assert kit.last_error_line(missing + "\n") == missing
    assert kit.last_error_line("just this\n") == "just this"


def test_a_full_pytest_step_runs_the_gpu_tests_first_and_leaves_time_for_the_rest(tmp_path, monkeypatch):
    limits = []

    def run(command, log, timeout, env_changes=None, cwd=None):
        limits.append((command, timeout))
        gpu = steps.CUDA_TESTS in command and "--ignore" not in command
        text = ("==== short test summary info ====\nFAILED tests/test_cuda.py::test_x[sm90_128x256] - assert 0 == 1\n"
                "1 failed, 99 passed in 9s\n" if gpu else "200 passed in 5s\n")
        return runner.Completed(1 if gpu else 0, text, 1.0, False)

    monkeypatch.setattr(runner, "run", run)
    args = kit.parse_args(["--out", str(tmp_path / "o"), "--scratch", str(tmp_path / "s"), "--deadline", "0",
                           "--steps", "pytest"])
    ctx = kit.context(args, gpu_facts(tmp_path))
    with open(tmp_path / "log", "w") as log:
        status, reason = kit.run_checks(kit.Run(args, gpu_facts(tmp_path), log), ctx, "pytest")
    assert status == FAIL
    assert reason == ("GPU tests: 99 passed, 1 failed; first: tests/test_cuda.py::test_x[sm90_128x256]; "
                      "other tests: 200 passed")
    (first, first_limit), (second, second_limit) = limits
    assert first[-1] == steps.CUDA_TESTS and second[-1] == "tests" and "-n" in second
    gpu_share = steps.GPU_TESTS_SHARE / (steps.GPU_TESTS_SHARE + 1)
    step_time = steps.timeout("pytest", False)
    assert step_time * gpu_share - 1 <= first_limit <= step_time * gpu_share
    assert step_time - 1 <= second_limit <= step_time  # all that is left (the canned first took no time)


def test_pytest_workers_are_half_the_cores_within_1_and_8():
    assert [steps.pytest_workers(c) for c in (1, 2, 4, 16, 64)] == [1, 1, 2, 8, 8]


def test_a_suite_stopped_at_its_limit_still_says_what_it_found(tmp_path):
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_fails():\n    assert 1 == 2\n\ndef test_slow():\n    time.sleep(60)\n")
    with open(tmp_path / "log", "w") as log:
        done = runner.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          log, timeout=8, cwd=str(tmp_path))
    assert done.timed_out and done.seconds < 30
    assert verdicts.pytest_verdict(done.output, done.returncode) == (
        FAIL, "1 failed; first: test_slow.py::test_fails")


def test_runner_ends_a_command_past_its_limit(tmp_path):
    with open(tmp_path / "log", "w") as log:
        done = runner.run([sys.executable, "-c", "print('started', flush=True); import time; time.sleep(60)"],
                          log, timeout=1)
    assert done.timed_out and done.returncode != 0 and done.seconds < 30
    assert "started" in done.output and "stopped after" in (tmp_path / "log").read_text()


# ---- the profile: Nsight Compute's CSV and the report ------------------------------------

NCU_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def ncu_rows(kernel_id, name, metrics):
    return [f'"{kernel_id}","42","python3","h","{name}","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0",'
            f'"GPU Speed Of Light Throughput","{metric}","{unit}","{value}"' for metric, unit, value in metrics]


def canned_ncu_csv(order, gemm_ns="1,234,567"):
    """ncu's output for the contenders in `order`: ==PROF== lines, then per contender the
    marker kernel and its own kernels (groupgemm: a setup kernel and a GEMM)."""
    lines, kernel_id = ["==PROF== Connected to process 42 (/usr/bin/python3)", NCU_HEADER], 0
    for op, name in order:
        kernels = [(f"at::cuda::{profile_shape.MARKER}(long)", [("Duration", "nsecond", "1,000")])]
        if name.startswith("groupgemm"):
            kernels.append(("groupgemm::setup_kernel(groupgemm::SetupArgs)", [("Duration", "ns", "4,500")]))
        kernels.append((f"cutlass::Kernel<cutlass::gemm::kernel::GemmGrouped<{op}, {name}>>(Params)",
                        [("Duration", "nsecond", gemm_ns), ("Compute (SM) Throughput", "%", "81.25"),
                         ("Registers Per Thread", "register/thread", "168"), ("Block Limit SM", "block", "n/a")]))
        for name_, metrics in kernels:
            lines += ncu_rows(kernel_id, name_, metrics)
            kernel_id += 1
    return "\n".join(lines) + "\n==PROF== Disconnected from process 42\n"


def test_ncu_csv_is_read_per_kernel_and_split_at_the_markers():
    order = profile_shape.contenders(["sm80", "sm90_128x256"])
    assert len(order) == 9 and order[:3] == [("forward", "groupgemm sm80"), ("forward", "groupgemm sm90_128x256"),
                                             ("forward", profile_shape.DENSE)]
    kernels = profile_shape.read_ncu_kernels(canned_ncu_csv(order))
    assert len(kernels) == 9 * 2 + 6  # a marker each, a GEMM each, a setup kernel per groupgemm call
    assert kernels[2][1] == {"Duration": 1234.567, "Compute (SM) Throughput": 81.25, "Registers Per Thread": 168.0}
    assert kernels[1][1] == {"Duration": 4.5}  # "ns", as ncu 2025.3 prints base units, is read as ns too
    by = profile_shape.kernels_by_contender(kernels, order)
    assert [len(by[key]) for key in order] == [2, 2, 1] * 3
    assert "setup_kernel" in by[("wgrad", "groupgemm sm90_128x256")][0][0]
    # A report of another run (other contenders) is not matched to this one.
    assert profile_shape.kernels_by_contender(kernels, profile_shape.contenders(["sm80"])) is None
    assert profile_shape.read_ncu_kernels("==PROF== no kernels were profiled\n") == []


def test_kernel_names_lose_their_template_arguments():
    short = profile_shape.short_kernel_name
    assert short("cutlass::Kernel<cutlass::gemm::GemmGrouped<A<B>, C>>(Params)") == "cutlass::Kernel<...>"
    assert short("void at::cuda::spin_kernel(long)") == "void at::cuda::spin_kernel"
    assert len(short("x" * 100)) == 60


def test_profile_report_has_tflops_ratios_and_kernels():
    order = profile_shape.contenders(["sm80"])
    times = {key: (2e-3 if key[1] == profile_shape.DENSE else 2.5e-3) for key in order}
    ncu = profile_shape.kernels_by_contender(profile_shape.read_ncu_kernels(canned_ncu_csv(order)), order)
    text = profile_shape.report(times, ncu, "H100, torch 2.9")
    tflops = profile_shape.flops() / 2.5e-3 / 1e12
    assert f"| forward | groupgemm sm80 | 2.500 | {tflops:.0f} | 0.80 |  |" in text
    assert "| wgrad | dense torch.mm | 2.000 |" in text and "| 1.00 |" in text
    assert "| dgrad | groupgemm sm80 | `cutlass::Kernel<...>` | 1234.6 | 81.2 |  | 168.0 |  |" in text
    assert "No Nsight Compute figures" in profile_shape.report(times, None, "H100")


def test_profile_report_compares_with_torch_grouped_mm_when_timed():
    order = profile_shape.contenders(["sm80", "sm90_64x128"], grouped_mm=True)
    assert [name for op, name in order if op == "dgrad"] == [
        "groupgemm sm80", "groupgemm sm90_64x128", profile_shape.GROUPED_MM, profile_shape.DENSE]
    seconds = {"groupgemm sm80": 4e-3, "groupgemm sm90_64x128": 2.5e-3, profile_shape.GROUPED_MM: 3e-3,
               profile_shape.DENSE: 2e-3}
    text = profile_shape.report({key: seconds[key[1]] for key in order}, None, "H100")
    assert "| GEMM | contender | ms (median) | TFLOP/s | vs dense | vs torch._grouped_mm |" in text
    assert "| wgrad | groupgemm sm90_64x128 | 2.500 |" in text and "| 0.80 | 1.20 |" in text
    assert "| forward | groupgemm sm80 | 4.000 |" in text and "| 0.50 | 0.75 |" in text


# ---- the sanitizer driver's plan and checks -----------------------------------------------

@pytest.mark.parametrize("family", driver_calls.FAMILIES)
def test_the_quick_cases_reach_every_kernel_and_instantiation(family):
    import sanitizer_driver as driver

    def reached(names):
        found = set()
        for name in names:
            case = driver.ALL_CASES[name]
            busy = driver.has_busy_group(case)
            for dtype in driver_calls.DTYPES:
                for call in driver_calls.calls_for(dtype):
                    found |= driver_calls.kernels_reached(call, case.m, case.k, case.n, case.g, busy, family)
        return found

    required = driver_calls.required_kernels(family)
    # 2 small kernels (the setup, which also fills, and the bias gradient); float32 CUTLASS:
    # 3 layouts + 2 forward bias rows + 1 accumulate; bfloat16 and float16, CUTLASS and
    # unaligned each: 2 output dtypes x 3 layouts + 2 bias rows + accumulate + a float32
    # output's bias rows (C = D).
    assert len(required) == 2 + 6 + 2 * 2 * 10
    assert required <= reached(driver.QUICK_CASES)
    aligned_only = [n for n in driver.QUICK_CASES if not n.startswith("unaligned")]
    assert {k[0] for k in required - reached(aligned_only) if isinstance(k, tuple)} == {driver_calls.UNALIGNED}
    # Under an sm90 tile the 3.x kernels take every aligned 16-bit GEMM, the bias epilogue
    # included: all 10 per 16-bit dtype.
    sm90 = {k for k in required if isinstance(k, tuple) and k[0].startswith(f"{driver_calls.CUTLASS} sm90")}
    assert len(sm90) == (2 * 10 if family != "sm80" else 0)
    assert {k[0] for k in sm90} <= {f"{driver_calls.CUTLASS} {family}"}
    assert all(k[1] in driver_calls.SIXTEEN_BIT for k in sm90)


@pytest.mark.parametrize("name", ["skewed", "window_middle", "zero_k", "all_empty", "unaligned_k"])
def test_the_driver_checks_pass_on_the_cpu_backend_and_catch_wrong_results(name):
    torch = pytest.importorskip("torch")
    import sanitizer_driver as driver

    from groupgemm import _core

    dev = driver.Device(torch, _core, "cpu")
    case = driver.ALL_CASES[name]
    x = driver.inputs(case)
    for dtype in ("float32", "bfloat16"):
        for call in driver_calls.calls_for(dtype):
            got, want, exact, exact_value = driver.run_call(dev, call, case, x, "nan")
            assert driver.mismatch(call, got, want, exact, exact_value) is None, call.name
            if got.size and exact.any():
                spoiled = got.copy()
                spoiled[exact] += 1.0  # a padding row, an empty group or an untouched accumulator
                assert driver.mismatch(call, spoiled, want, exact, exact_value) is not None
            if got.size and not exact.all():
                spoiled = got.copy()
                spoiled[~exact] += 0.5 * max(1.0, abs(want).max())
                assert "max error" in driver.mismatch(call, spoiled, want, exact, exact_value)


# ---- the expert layer's calls in the sanitizer driver ------------------------------------

def test_the_quick_expert_cases_reach_every_expert_kernel():
    import expert_driver

    def reached(names):
        found = set()
        for name in names:
            for _, kernels in expert_driver.planned_calls(expert_driver.ALL_EXPERT_CASES[name]):
                found |= kernels
        return found

    required = driver_calls.required_expert_kernels()
    # permute: 4 kernels, 2 scans over several tiles, capped chunks, 2 fill word sizes;
    # unpermute's backward: its row sort, in several radix passes; unpermute, the backward's
    # row kernel and dprobs kernel: 5 (values, probs) pairs each; the activations: 2 x 3
    # dtypes; the router: 3 x 3.
    assert len(required) == 9 + 2 + 3 * 5 + 2 * 3 + 3 * 3
    assert required <= reached(expert_driver.QUICK_EXPERT_CASES)
    assert required <= reached(expert_driver.ALL_EXPERT_CASES)
    small = [n for n in expert_driver.QUICK_EXPERT_CASES if not n.startswith("many_")]
    assert {k[1] for k in required - reached(small)} == {driver_calls.SEVERAL_TILES, driver_calls.CAPPED_CHUNKS}
    cases = expert_driver.EXPERT_CASES
    assert {c.top_k for c in cases} >= {1, 2, 3, 4} and max(c.slots for c in cases) >= 70000
    assert {c.routing for c in cases} >= {"one_expert", "all_dropped"} and any(c.repeat_rows for c in cases)
    assert any(c.tokens == 0 for c in cases) and any(c.experts == 0 and c.tokens for c in cases)


def test_the_restated_permute_workspace_matches_the_core():
    pytest.importorskip("torch")
    from groupgemm import _core

    for slots, experts in [(0, 0), (0, 3), (1, 0), (70000, 8), (18000, 4200), (10**7, 3), (5, 2**20)]:
        assert driver_calls.permute_workspace_bytes(slots, experts) == _core.permute_workspace_bytes(
            _core.Device.cuda, slots, experts), (slots, experts)
        assert _core.permute_workspace_bytes(_core.Device.cpu, slots, experts) == 0


def _spoiled(t, index, delta):
    """A copy of host tensor t with `delta` added to the entry at `index` (in float64)."""
    import torch

    values = t.double().numpy().copy()
    values[index] += delta
    return torch.from_numpy(values).to(t.dtype)


@pytest.mark.parametrize("name", ["top1", "top2", "no_tokens", "all_dropped", "no_experts", "one_expert",
                                  "zero_hidden"])
def test_the_expert_checks_pass_on_the_cpu_backend_and_catch_wrong_results(name):
    torch = pytest.importorskip("torch")
    import expert_driver
    import numpy as np
    import sanitizer_driver as driver

    from groupgemm import _core

    cpu = driver.Device(torch, _core, "cpu")
    case = expert_driver.ALL_EXPERT_CASES[name]
    x = expert_driver.expert_inputs(case)
    row_map = expert_driver.row_map_of(cpu, case, x)
    for call, _ in expert_driver.planned_calls(case):
        for prefill in ("nan", "empty"):
            results = expert_driver.run_expert_call(cpu, cpu, call, case, x, row_map, prefill)
            assert [expert_driver.result_mismatch(r) for r in results] == [None] * len(results), call.name
        for r in results:
            if not r.got.numel():
                continue
            want = r.want.double().numpy()
            exact = (np.broadcast_to(r.exact, want.shape) if r.exact is not None
                     else np.full(want.shape, np.all(np.asarray(r.tolerance) == 0)))
            if exact.any():  # a dropped row, an index or a zero output changed
                i = tuple(np.argwhere(exact)[0])
                wrong = expert_driver.Result(r.what, _spoiled(r.got, i, 1.0), r.want, r.tolerance, r.exact)
                assert expert_driver.result_mismatch(wrong), (call.name, r.what)
            if not exact.all():
                i = tuple(np.argwhere(~exact)[0])
                wrong = expert_driver.Result(r.what, _spoiled(r.got, i, 0.5 * max(1.0, abs(want[i]))), r.want,
                                             r.tolerance, r.exact)
                assert "beyond the tolerance" in expert_driver.result_mismatch(wrong), (call.name, r.what)
                if r.got.dtype == torch.float32 and want[i] != 0:  # one float32 ulp is within every tolerance
                    nudged = r.got.clone()
                    nudged.view(-1)[np.ravel_multi_index(i, want.shape)] = float(np.nextafter(
                        np.float32(want[i]), np.float32(np.inf)))
                    assert expert_driver.result_mismatch(
                        expert_driver.Result(r.what, nudged, r.want, r.tolerance, r.exact)) is None, (call.name, r.what)


def test_the_driver_rehearses_gemm_and_expert_cases_on_the_cpu_backend(capsys):
    pytest.importorskip("torch")
    import sanitizer_driver as driver

    assert driver.main(["--device", "cpu", "--cases", "zero_k", "--expert-cases", "top3", "no_tokens_no_experts"]) == 0
    out = capsys.readouterr().out
    assert "over 1 GEMM cases (sm80 kernels) and 2 expert-layer cases on cpu" in out and "RESULT: PASS" in out


def test_the_kit_expects_every_skip_reason_the_tests_give_on_a_gpu_machine():
    # The reason a test without an extra skips for (tests/helpers/clients.py) must be one
    # the pytest step accepts, or a GPU run would read INCOMPLETE for it.
    import clients
    import steps

    assert any(clients.NOT_INSTALLED in reason or reason in clients.NOT_INSTALLED for reason in steps.EXPECTED_SKIPS)


def test_the_kit_expects_the_gpu_tests_skips_on_hopper_and_elsewhere():
    # On Hopper the FP8 refusal test of other GPUs skips, elsewhere the sm_90a tests do
    # (tests/test_cuda.py's two reasons, read from its source).
    import ast

    with open(os.path.join(ROOT, "tests", "test_cuda.py")) as f:
        module = ast.parse(f.read())
    names = ("HOPPER_ONLY", "NOT_ON_HOPPER")
    reasons = {node.targets[0].id: node.value.value for node in module.body
               if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") in names}
    assert len(reasons) == 2 and all(any(e in r for e in steps.EXPECTED_SKIPS) for r in reasons.values()), reasons


# ---- the FP8 calls of the sanitizer driver -------------------------------------------------

def test_the_fp8_driver_plans_every_fp8_gemm_instantiation_on_hopper():
    import fp8_driver

    gemms = [c for c in fp8_driver.planned_calls(hopper=True) if c.gemm]
    assert {(c.lhs_dtype, c.out_dtype) for c in gemms} == {(lhs, out) for lhs in ("float8_e4m3fn", "float8_e5m2")
                                                            for out in ("bfloat16", "float32")}
    assert {c.recipe for c in gemms} == {"rowwise", "blockwise"} and any(c.accumulate for c in gemms)
    assert not any(c.gemm for c in fp8_driver.planned_calls(hopper=False))  # elsewhere: quantization only


def test_the_fp8_driver_passes_on_the_cpu_backend_and_catches_wrong_results():
    torch = pytest.importorskip("torch")
    import fp8_driver

    import groupgemm.torch as gt

    count, failures = fp8_driver.run(torch, ["window_middle", "long_groups"], True, "cpu")
    assert failures == [] and count == 2 * len(fp8_driver.planned_calls(True))
    case = fp8_driver.ALL_FP8_CASES["skewed"]
    for call in fp8_driver.planned_calls(True):
        results = fp8_driver.run_call(torch, gt, call, case, "cpu")
        wrong = [r.clone() for r in results]
        if call.gemm:
            wrong[-1].view(-1)[0] += 0.1 * wrong[-1].abs().max() + 1  # beyond the tolerance
        else:
            wrong[0].view(torch.uint8).view(-1)[0] ^= 1  # one quantized value's last bit
        assert fp8_driver.mismatch(torch, call, case, wrong, results), call.name
