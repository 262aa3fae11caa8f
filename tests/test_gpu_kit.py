"""The lease kit (benchmarks/gpu/) on a machine without a GPU: its command line, how it
reads pytest's and compute-sanitizer's output, its plan and device call, whole lease runs
against canned command output on a simulated clock (a failing tile, a run cut by its
deadline, the kernel table it writes), the carried wheels, the profile's reading of Nsight
Compute's CSV, and the sanitizer driver's calls and checks on the CPU backend. The kit
itself only does its real work where there is a GPU."""

import csv
import json
import os
import signal
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
KIT_DIR = os.path.join(ROOT, "benchmarks", "gpu")

import driver_calls  # noqa: E402
import expert_mlp_report  # noqa: E402
import hlo_command_buffers  # noqa: E402
import kernel_table  # noqa: E402
import kit  # noqa: E402
import profile_shape  # noqa: E402
import results_dir  # noqa: E402
import runner  # noqa: E402
import steps  # noqa: E402
import tile_sweep  # noqa: E402
import transformers_report  # noqa: E402
import verdicts  # noqa: E402
import wheels  # noqa: E402
from verdicts import FAIL, INCOMPLETE, PASS, SKIP, Verdict  # noqa: E402

KIT = os.path.join(KIT_DIR, "kit.py")


def run_kit(*args):
    return subprocess.run([sys.executable, KIT, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


# ---- command line ---------------------------------------------------------------------

def test_defaults_point_into_the_repository_and_fit_the_lease():
    args = kit.parse_args([])
    repo = os.path.normpath(ROOT)
    assert args.run == "check" and args.deadline == 540  # the first command of a lease: at most 540 s
    assert args.wheels == os.path.join(repo, ".gpu-wheels")
    assert args.out == os.path.join(repo, "benchmarks", "results", "gpu")
    assert args.scratch == os.path.join(repo, "build", "gpu-kit")
    extra = kit.parse_args(["extra", "--out", "here"])
    assert extra.run == "extra" and extra.deadline == 240  # the second: at most 240 s
    assert extra.out == os.path.abspath("here")  # given: relative to the caller


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["quick"], "invalid choice: 'quick'"),
    (["--deadline", "0"], "--deadline must be more than 0 seconds"),
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
    ctx = kit.context(kit.parse_args(["--out", str(tmp_path)]), hopper_facts(tmp_path))
    assert all("-rfEs" in command.argv for step in ("gpu_tests", "suite") for command in steps.commands(step, ctx))


def test_summary_table_has_one_row_per_step_in_order():
    table = verdicts.render_table([Verdict("install", PASS, "installed 3 wheels", 11.4),
                                   Verdict("gpu_tests", FAIL, "1 failed | 3 passed", 120.0)])
    lines = table.splitlines()
    assert lines[0] == "| step | verdict | seconds | details |" and len(lines) == 4
    assert lines[2] == "| install | PASS | 11 | installed 3 wheels |"
    assert lines[3] == "| gpu_tests | FAIL | 120 | 1 failed \\| 3 passed |"


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


# ---- the carried wheels, the results folder ------------------------------------------------

def test_the_carried_wheels_are_found_by_name_version_and_python(tmp_path):
    for name in ("onednn_cpu_gomp-2023.2.0-py2.py3-none-manylinux1_x86_64.whl",
                 "groupgemm-0.1.0-cp311-cp311-manylinux_2_35_x86_64.whl",  # another Python: not this machine's
                 "scipy_openblas32-0.3.30.0-py3-none-manylinux_2_28_x86_64.whl"):  # another version
        (tmp_path / name).write_bytes(b"")
    found, missing = wheels.find_wheels(str(tmp_path))
    assert set(found) == {"onednn-cpu-gomp"}
    assert missing == ["groupgemm (cp312)", "scipy-openblas32==0.3.34.481.3",
                       *(f"{name}=={version}" for name, version in wheels.TRANSFORMERS)]
    (tmp_path / "groupgemm-0.1.0-cp312-cp312-manylinux_2_35_x86_64.whl").write_bytes(b"")
    assert os.path.basename(wheels.find_wheels(str(tmp_path))[0]["groupgemm"]).startswith("groupgemm-0.1.0-cp312")
    assert wheels.find_wheels(str(tmp_path / "absent"))[0] == {}


def test_a_dependency_is_cut_to_what_runs_with_a_record_that_lists_it(tmp_path):
    import hashlib
    source = tmp_path / "onednn_cpu_gomp-2023.2.0-py2.py3-none-manylinux1_x86_64.whl"
    data = {"onednn_cpu_gomp-2023.2.0.data/data/lib/libdnnl.so": b"x" * 100,
            "onednn_cpu_gomp-2023.2.0.data/data/lib/libdnnl.so.3": b"y" * 100,
            "onednn_cpu_gomp-2023.2.0.data/data/share/doc/onednn/LICENSE": b"licence",
            "onednn_cpu_gomp-2023.2.0.dist-info/METADATA": b"Name: onednn-cpu-gomp\n",
            "onednn_cpu_gomp-2023.2.0.dist-info/RECORD": b"stale\n"}
    with zipfile.ZipFile(source, "w") as z:
        for name, content in data.items():
            z.writestr(name, content)
    dest = tmp_path / "out" / source.name
    dest.parent.mkdir()
    wheels.trim(str(source), str(dest), wheels.KEEP["onednn-cpu-gomp"])
    with zipfile.ZipFile(dest) as z:
        names = set(z.namelist())
        record = z.read("onednn_cpu_gomp-2023.2.0.dist-info/RECORD").decode().splitlines()
    assert "onednn_cpu_gomp-2023.2.0.data/data/lib/libdnnl.so" not in names  # the copy nothing loads
    assert {"onednn_cpu_gomp-2023.2.0.data/data/lib/libdnnl.so.3",
            "onednn_cpu_gomp-2023.2.0.data/data/share/doc/onednn/LICENSE"} <= names
    listed = {line.split(",")[0]: line for line in record}
    assert set(listed) == names
    digest = hashlib.sha256(b"y" * 100).digest()
    import base64
    assert listed["onednn_cpu_gomp-2023.2.0.data/data/lib/libdnnl.so.3"].split(",")[1] == (
        "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode())


def test_dependencies_are_downloaded_for_the_gpu_machines_python():
    command = wheels.download_command("onednn-cpu-gomp", "2023.2.0", "DEST", python="python3")
    assert command[:4] == ["python3", "-m", "pip", "download"]
    for flag in ("--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"):
        assert flag in command
    assert command[-3:] == ["-d", "DEST", "onednn-cpu-gomp==2023.2.0"]


def test_transformers_and_what_it_imports_are_carried_as_dev_sh_pins_them():
    with open(os.path.join(ROOT, "dev.sh")) as f:
        pins = {}
        for word in f.read().split():
            if "==" in word:
                name, version = word.strip("\"'").split("==", 1)
                pins[name.lower().replace("_", "-")] = version
    carried = dict(wheels.TRANSFORMERS)
    assert carried["transformers"] == "5.23.0"
    assert {name: pins.get(name) for name in carried} == carried
    assert set(carried) <= {name for name, _ in wheels.DEPENDENCIES}


def test_gathering_trims_the_libraries_and_carries_the_rest_whole(tmp_path, monkeypatch):
    dist, dest = tmp_path / "dist", tmp_path / "dest"
    dist.mkdir()
    (dist / "groupgemm-0.1.0-cp312-cp312-manylinux_2_35_x86_64.whl").write_bytes(b"ours")
    files = {"onednn-cpu-gomp": {"onednn_cpu_gomp-2023.2.0.data/data/lib/libdnnl.so": b"x" * 100,
                                 "onednn_cpu_gomp-2023.2.0.data/data/lib/libdnnl.so.3": b"y" * 100},
             "tqdm": {"tqdm/__init__.py": b"", "tqdm/cli.py": b"main = None\n"}}

    def download(command):  # pip download's part: the pinned wheel into -d
        name, version = command[-1].split("==")
        folder = command[command.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(folder, f"{wheels.wheel_prefix(name, version)}py3-none-any.whl"), "w") as z:
            for path, data in files[name].items():
                z.writestr(path, data)
            z.writestr(f"{wheels.wheel_prefix(name, version)[:-1]}.dist-info/RECORD", "")
        return 0

    monkeypatch.setattr(wheels, "DEPENDENCIES", (("onednn-cpu-gomp", "2023.2.0"), ("tqdm", "4.70.1")))
    monkeypatch.setattr(wheels.subprocess, "call", download)
    assert wheels.gather(str(dest), str(dist)) == []
    with zipfile.ZipFile(dest / "onednn_cpu_gomp-2023.2.0-py3-none-any.whl") as z:
        assert "onednn_cpu_gomp-2023.2.0.data/data/lib/libdnnl.so" not in z.namelist()
    with zipfile.ZipFile(dest / "tqdm-4.70.1-py3-none-any.whl") as z:
        assert {"tqdm/__init__.py", "tqdm/cli.py"} <= set(z.namelist())  # no KEEP entry: whole
    assert set(wheels.find_wheels(str(dest))[0]) == {"groupgemm", "onednn-cpu-gomp", "tqdm"}


def test_what_travels_is_the_tracked_files_and_the_carried_folder(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/ignored/\n")
    (repo / "tracked.txt").write_bytes(b"a" * 1000)
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_bytes(b"b" * 5000)
    (repo / "carried").mkdir()
    (repo / "carried" / "w.whl").write_bytes(b"c" * 300)
    base = wheels.travel_bytes(str(repo))
    assert base == 1000 + len("/ignored/\n") + 300  # untracked files git would take travel too
    subprocess.run(["git", "-C", str(repo), "add", "tracked.txt"], check=True)
    assert wheels.travel_bytes(str(repo), [str(repo / "ignored")]) == base + 5000


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
    assert all(len(results_dir.files(run)) <= results_dir.MAX_FILES for run in steps.RUNS)


def test_site_dir_is_found_wherever_pip_put_it(tmp_path):
    site = tmp_path / "local" / "lib" / "python3.12" / "dist-packages"
    (site / "onednn_cpu_gomp-2023.2.0.dist-info").mkdir(parents=True)
    assert kit.find_site_dir(str(tmp_path)) == str(site)
    guess = kit.find_site_dir(str(tmp_path / "empty"))
    assert guess.endswith(os.path.join("lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages"))
    assert kit.find_site_dir(str(tmp_path / "empty"), "3.12").endswith(os.path.join("python3.12", "site-packages"))


# ---- the plan and the device call ----------------------------------------------------------

def hopper_facts(tmp_path, sanitizer="/usr/local/cuda/bin/compute-sanitizer", ncu="/usr/local/cuda/bin/ncu",
                 cpus=16):
    found = {name: str(tmp_path / f"{name}.whl") for name in ("groupgemm", "onednn-cpu-gomp", "scipy-openblas32")}
    for path in found.values():
        open(path, "ab").close()
    return kit.Facts([("NVIDIA H100 80GB HBM3", "580.65", "9.0")], sanitizer, ncu, found, [], "python3.12", cpus)


def test_dev_sh_dry_run_prints_the_device_call_and_each_steps_deadline(tmp_path):
    proc = subprocess.run([os.path.join(ROOT, "dev.sh"), "gpu", "--dry-run", "--wheels", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    command = next(line for line in out.splitlines() if line.startswith("  command ("))
    length = int(command.split("(")[1].split(" of ")[0])
    assert length <= kit.COMMAND_LIMIT and command.endswith("--deadline 540")
    assert "python3 benchmarks/gpu/kit.py check --wheels" in command and '--out "$OUT"' in command
    assert "  carry: " in out and "travels in all:" in out and "limit 60 MiB" in out
    assert out.count("MISSING") == 1 + len(wheels.DEPENDENCIES)  # an empty wheels folder
    ends = []
    for number, name in enumerate(steps.RUNS["check"], start=1):
        line = next(line for line in out.splitlines() if line.startswith(f"{number}. {name} (limit "))
        ends.append(int(line.split("done by ")[1].split(" s)")[0]))
    assert ends == sorted(ends) and ends[-1] <= 540 - steps.SUMMARY_RESERVE_S
    assert not os.path.exists(os.path.join(str(tmp_path), "prefix"))  # nothing was installed


def test_the_plan_for_a_hopper_machine_has_every_command(tmp_path):
    args = kit.parse_args(["--wheels", str(tmp_path), "--dry-run"])
    plan = kit.plan_text(args, hopper_facts(tmp_path))
    assert "SKIPPED" not in plan
    assert "--prefix /tmp/groupgemm-kit/prefix" in plan and "groupgemm.whl" in plan
    assert "-m pytest -q -rfEs -p no:cacheprovider -n 8 tests/test_cuda.py tests/test_cuda_build.py" in plan
    tiles = kernel_table.read().tile_names
    for tool in steps.SANITIZER_TOOLS:  # one process per tool and part: each family, and the expert/FP8 kernels
        for part in ("sm80", *tiles, steps.LAYER_PART):
            assert f"--tool {tool} " in plan and f"--quick --part {part} --prefill " in plan
    assert plan.count("compute-sanitizer --tool") == len(steps.SANITIZER_TOOLS) * (len(tiles) + 2)
    bench = plan.index("tile_sweep.py --out '$OUT/tiles.csv'")
    assert bench < plan.index("benchmarks/bench.py --device cuda") < plan.index("benchmarks/fp8_bench.py")
    assert "--shapes 128,16384,2048,1408 32,16384,7168,2048 8,16384,4096,14336" in plan
    for tile in tiles:  # each tile alone is timed per GEMM by the sweep, not again through the frameworks
        assert f"'groupgemm {tile}'" in plan
    assert "jax_capture_check.py --command-buffers custom-calls" in plan and "capture_check.py" in plan
    extra = kit.plan_text(kit.parse_args(["extra", "--wheels", str(tmp_path)]), hopper_facts(tmp_path))
    assert "ncu --target-processes all --profile-from-start off --clock-control none" in extra
    assert "--ignore tests/test_cuda.py --ignore tests/test_cuda_build.py tests" in extra
    assert ("HF_HUB_OFFLINE=1 python3.12 ./benchmarks/transformers_experts.py --device cuda --scale 1 --dtype bfloat16 "
            "--train-tokens 4096 16384 --decode-tokens 1 8 32 ") in extra
    assert "--json '$OUT/transformers_experts.json'" in extra
    assert extra.index("6. transformers (limit 90 s, done by 230 s)") > extra.index("5. suite (limit ")
    assert extra.index("4. fused (limit 45 s,") > extra.index("3. profile (limit ")
    assert ("./benchmarks/expert_mlp_fused.py --device cuda --frameworks torch jax --shapes qwen3-30b-a3b/2 small-F "
            "--dtype bfloat16 --scale 2 --kernels default sm90 ") in extra
    assert "--json '$OUT/expert_mlp_fused.json'" in extra


def test_the_steps_run_in_priority_order_within_the_deadline():
    for run, deadline in steps.DEADLINE.items():
        limits = kit.step_limits(run, deadline)
        assert [name for name, _, _ in limits] == list(steps.RUNS[run])
        assert limits[0][0] == "install" and limits[-1][2] <= deadline - steps.SUMMARY_RESERVE_S
        assert all(limit <= steps.LIMITS[name] for name, limit, _ in limits)
    assert steps.RUNS["check"].index("gpu_tests") < steps.RUNS["check"].index("sanitizer") < \
        steps.RUNS["check"].index("bench") < steps.RUNS["check"].index("decision")
    assert steps.DEADLINE["check"] <= 540 and steps.DEADLINE["extra"] <= 240
    # The fused expert MLP's cells right after the profile, the transformers cells last.
    assert steps.RUNS["extra"][-1] == "transformers" and "transformers" not in steps.RUNS["check"]
    assert steps.RUNS["extra"][:-1] == ("install", "environment", "profile", "fused", "suite")


def test_the_transformers_step_runs_the_benchmark_at_qwen3_30b_a3b_in_bfloat16(tmp_path):
    pytest.importorskip("torch")
    import transformers_experts

    ctx = kit.context(kit.parse_args(["extra", "--out", str(tmp_path)]), hopper_facts(tmp_path))
    (command,) = steps.commands("transformers", ctx)
    assert command.argv[1].endswith(os.path.join("benchmarks", "transformers_experts.py"))
    args = transformers_experts.parse_args(command.argv[2:])  # the benchmark's own reading of it
    assert (args.device, args.scale, args.dtype, args.experts, args.top_k) == ("cuda", 1, ["bfloat16"], 128, 8)
    assert args.json == os.path.join(str(tmp_path), results_dir.TRANSFORMERS_JSON)
    assert transformers_report.planned_cells(args.dtype, args.train_tokens, args.decode_tokens) == \
        TRANSFORMERS_CELLS and len(TRANSFORMERS_CELLS) == 7
    # batched_mm copies two bfloat16 expert weights (hidden x 2 ffn, ffn x hidden) per token
    # slot: every decode cell runs it, no training cell could.
    per_slot_gb = 3 * 2048 * 768 * 2 / 1e9
    assert max(args.decode_tokens) * 8 * per_slot_gb <= args.max_gather_gb < min(args.train_tokens) * 8 * per_slot_gb
    assert command.env["HF_HUB_OFFLINE"] == "1" and command.env["PYTHONPATH"].startswith(ctx.site_dir)


def test_the_transformers_digest_gives_each_phases_range_of_the_fastest_built_in():
    rows = canned_transformers_rows(TRANSFORMERS_CELLS[:2], grouped_mm=0.8)
    rows += canned_transformers_rows(TRANSFORMERS_CELLS[2:3], grouped_mm=1.25)
    rows += [{**r, "vs_groupgemm": 0.5} if r["impl"] == "eager" else r
             for r in canned_transformers_rows(TRANSFORMERS_CELLS[3:4])]  # eager fastest in one cell
    rows += [r for r in canned_transformers_rows(TRANSFORMERS_CELLS[4:5]) if r["impl"] == "groupgemm"]
    assert transformers_report.digest(rows) == "forward 0.80x, forward+backward 0.50-1.25x"
    table = transformers_report.markdown_table(rows)
    assert "| bfloat16 | forward+backward | 16384 | 2.00 | 0.90 | n/a | 0.50 | 0.50 |" in table
    assert "| bfloat16 | decode forward | 1 | 2.00 | n/a | n/a | n/a | n/a |" in table


def test_a_failed_test_is_put_down_to_the_kernel_it_ran_on():
    assert kit.kernel_of_test("tests/test_cuda.py::test_x[torch-basic-bfloat16-plain-sm90_64x128]") == "sm90_64x128"
    assert kit.kernel_of_test("tests/test_cuda.py::test_x[sm90-torch-basic]") == "sm90"
    assert kit.kernel_of_test("tests/test_cuda.py::test_x[default-jax]") == "default"
    assert kit.kernel_of_test("tests/test_cuda.py::test_fp8_layer[blockwise-torch]") is None
    assert kit.kernel_of_test("tests/test_cuda.py::test_plain") is None


# ---- whole lease runs, against canned output on a simulated clock ------------------------------

TILES = kernel_table.read().tile_names
SOURCE_TABLE = open(kernel_table.TABLE).read()  # before any test points kernel_table.TABLE at a copy
PYTEST_PASS = ("....\n==== short test summary info ====\n"
               "SKIPPED [2] tests/test_cuda.py:99: the refusal of a GPU without FP8 tensor cores cannot run on "
               "Hopper\n1200 passed, 2 skipped in 95.1s\n")


def canned_tile_sweep(path, fastest):
    """A tile sweep's CSV: every kernel at every cell, `fastest` the quickest everywhere,
    the 2.x kernels slowest."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, tile_sweep.COLUMNS)
        writer.writeheader()
        for experts, tokens, hidden, ffn in steps.BENCH_CELLS:
            for gemm in profile_shape.OPS:
                side = tile_sweep.smaller_side(gemm, experts, tokens, hidden, ffn)
                for rank, kernel in enumerate([fastest] + [k for k in TILES if k != fastest] + ["sm80"]):
                    ms = 1.0 + 0.1 * rank
                    writer.writerow({"cell": tile_sweep.cell_name(experts, tokens, hidden, ffn, "uniform"),
                                     "experts": experts, "tokens": tokens, "hidden": hidden, "ffn": ffn,
                                     "routing": "uniform", "gemm": gemm, "smaller_side": side, "kernel": kernel,
                                     "ms": ms, "tflops": 1.0})


TRANSFORMERS_CELLS = transformers_report.planned_cells(
    [steps.TRANSFORMERS_DTYPE], steps.TRANSFORMERS_TRAIN_TOKENS, steps.TRANSFORMERS_DECODE_TOKENS)


def canned_transformers_rows(cells=TRANSFORMERS_CELLS, grouped_mm=0.9, wrong=None):
    """transformers_experts.py's rows: groupgemm 2 ms everywhere, grouped_mm `grouped_mm`
    times that, eager 20 times, batched_mm at decode cells only (1.5 times); `wrong`, a
    cell where grouped_mm disagrees with eager."""
    rows = []
    for dtype, phase, tokens in cells:
        for impl, ratio in (("groupgemm", 1.0), ("grouped_mm", grouped_mm), ("batched_mm", 1.5), ("eager", 20.0)):
            row = {"dtype": dtype, "phase": phase, "tokens": tokens, "device": "cuda", "impl": impl}
            if impl == "batched_mm" and phase != "decode forward":
                row["error"] = "not run: would gather 309.2 GB of expert weights"
            else:
                check = "FAIL" if impl == "grouped_mm" and (dtype, phase, tokens) == wrong else "ok"
                row.update(max_rel_error=4e-3, check=check, ms=2.0 * ratio, samples=10, vs_groupgemm=ratio)
            rows.append(row)
    return rows


FUSED_CELLS = expert_mlp_report.planned_cells(steps.FUSED_FRAMEWORKS, steps.FUSED_SHAPES, [steps.FUSED_DTYPE],
                                              driver_calls.mlp_families_on(hopper=True))


def canned_fused_rows(cells=FUSED_CELLS, ratio=0.8, wrong=None):
    """expert_mlp_fused.py's rows on CUDA: the fused op `ratio` of the composition's time,
    0.3 of its saved bytes; the cell `wrong` disagreeing."""
    rows = []
    for framework, shape, dtype, kernel in cells:
        row = {"framework": framework, "shape": shape, "dtype": dtype, "device": "cuda", "kernel": kernel,
               "max_rel_error": 0.5 if (framework, shape, dtype, kernel) == wrong else 4e-3,
               "check": "FAIL" if (framework, shape, dtype, kernel) == wrong else "ok",
               "fused_saved_bytes": 3 * 2**20, "composed_saved_bytes": 10 * 2**20, "saved_bytes_ratio": 0.3,
               "fused_ms": 10.0 * ratio, "composed_ms": 10.0, "ms_ratio": ratio}
        if framework == "torch":
            row.update(fused_peak_bytes=5 * 2**20, composed_peak_bytes=10 * 2**20, peak_bytes_ratio=0.5)
        rows.append(row)
    return rows


class FakeMachine:
    """Runs no command: answers each with canned output after canned seconds on a
    simulated clock, and records the order. The transformers and fused benchmarks write
    `transformers_rows` and `fused_rows` as their JSON (none when None)."""

    def __init__(self, seconds=None, outputs=None, fastest_tile=TILES[-1], returncodes=None,
                 transformers_rows=canned_transformers_rows(), fused_rows=canned_fused_rows()):
        self.now, self.seen = 0.0, []
        self.seconds, self.outputs, self.fastest_tile = seconds or {}, outputs or {}, fastest_tile
        self.returncodes, self.transformers_rows, self.fused_rows = returncodes or {}, transformers_rows, fused_rows

    def clock(self):
        return self.now

    @staticmethod
    def key(argv):
        if "pytest" in argv:
            return "suite" if "--ignore" in argv else "gpu_tests"
        if "--tool" in argv:
            return f"sanitizer {argv[argv.index('--tool') + 1]} {argv[argv.index('--part') + 1]}"
        script = next((os.path.basename(a) for a in argv if a.endswith(".py")), argv[0])
        return "pip" if "pip" in argv else script

    def execute(self, argv, log, timeout, env=None, cwd=None):
        key = self.key(argv)
        self.seen.append(key)
        if key == "tile_sweep.py":
            canned_tile_sweep(argv[argv.index("--out") + 1], self.fastest_tile)
        if key == "expert_mlp_fused.py" and self.fused_rows is not None:
            with open(argv[argv.index("--json") + 1], "w") as f:
                json.dump({"command": "python benchmarks/expert_mlp_fused.py --device cuda",
                           "machine": {"gpu": "NVIDIA H200"}, "results": self.fused_rows}, f)
        if key == "transformers_experts.py" and self.transformers_rows is not None:
            with open(argv[argv.index("--json") + 1], "w") as f:
                json.dump({"transformers": "5.23.0", "machine": {"gpu": "NVIDIA H100 80GB HBM3"},
                           "shape": {"hidden": 2048, "moe_intermediate": 768, "experts": 128, "top_k": 8},
                           "results": self.transformers_rows}, f)
        text = self.outputs.get(key)
        if text is None:
            text = (PYTEST_PASS if key in ("gpu_tests", "suite") else
                    "========= ERROR SUMMARY: 0 errors\nRESULT: PASS calls match\n" if key.startswith("sanitizer")
                    else "Successfully installed\n" if key == "pip" else f"RESULT: PASS {key}\n")
        seconds = self.seconds.get(key, 1.0)
        timed_out = seconds > timeout
        self.now += min(seconds, timeout)
        log.write(text)
        failed = "FAILED" in text or "RESULT: FAIL" in text or timed_out
        returncode = self.returncodes.get(key, 1 if failed else 0)
        return runner.Completed(returncode, text, min(seconds, timeout), timed_out)


def lease(tmp_path, monkeypatch, machine, run="check", facts=None):
    """A whole run of the kit on `machine`, with its own copy of the kernel table."""
    table = tmp_path / "hopper_kernels.def"
    table.write_text(SOURCE_TABLE)
    monkeypatch.setattr(kernel_table, "TABLE", str(table))
    monkeypatch.setattr(kit, "detect", lambda args: facts or hopper_facts(tmp_path))
    out = tmp_path / "out"
    code = kit.main([run, "--out", str(out), "--scratch", str(tmp_path / "scratch")], execute=machine.execute,
                    clock=machine.clock, parallel=False)
    summary = (out / results_dir.summary_md(run)).read_text()
    return code, summary, out, table


def verdict_rows(summary):
    """{step: verdict} from the summary's table (its other tables' rows name no step)."""
    return {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in summary.splitlines()
            if line.startswith("| ") and " | " in line and line.split(" | ")[0][2:] in steps.LIMITS}


def test_a_whole_lease_runs_every_step_in_priority_order_and_writes_the_table(tmp_path, monkeypatch):
    machine = FakeMachine(fastest_tile=TILES[-1])
    code, summary, out, table = lease(tmp_path, monkeypatch, machine)
    assert code == 0, summary
    rows = verdict_rows(summary)
    assert list(rows) == list(steps.RUNS["check"]) and set(rows.values()) == {PASS}
    firsts = [next(i for i, k in enumerate(machine.seen) if k.startswith(prefix))
              for prefix in ("pip", "environment", "gpu_tests", "sanitizer", "jax_capture", "tile_sweep", "bench.py",
                             "fp8_bench")]
    assert firsts == sorted(firsts)  # the priority order
    assert sum(k.startswith("sanitizer") for k in machine.seen) == 4 * (len(TILES) + 2)
    written = kernel_table.read(str(table))
    assert written.choices == tuple(kernel_table.Choice(c.smaller_side_at_most, TILES[-1], TILES[-1])
                                    for c in written.choices)  # the fastest passing kernel everywhere
    assert "the GPU kit on NVIDIA H100 80GB HBM3" in written.chosen_by
    assert (out / results_dir.KERNEL_TABLE).read_text() == table.read_text()  # it comes back with the results
    assert set(os.listdir(out)) <= set(results_dir.files("check")) and results_dir.budget_problems(str(out)) == []
    assert "## The kernel table's decision" in summary and "every kernel passed" in summary


def test_a_failing_tile_is_left_out_of_the_decision(tmp_path, monkeypatch):
    bad = TILES[-1]  # the fastest in the sweep, but a test on it failed
    failing = ("==== short test summary info ====\n"
               f"FAILED tests/test_cuda.py::test_cuda_matches_cpu_backend[torch-tiles-bfloat16-plain-{bad}] - assert\n"
               "1 failed, 1199 passed in 95.1s\n")
    machine = FakeMachine(outputs={"gpu_tests": failing}, fastest_tile=bad)
    code, summary, _, table = lease(tmp_path, monkeypatch, machine)
    assert code == 1 and verdict_rows(summary)["gpu_tests"] == FAIL
    assert f"failures by kernel: {bad}: 1" in summary
    assert verdict_rows(summary)["decision"] == PASS  # the others still decide
    chosen = kernel_table.read(str(table)).choices
    assert all(bad not in (c.default, c.sm90) for c in chosen)
    runner_up = next(t for t in TILES if t != bad)  # the next fastest in the canned sweep
    assert all(c.default == runner_up and c.sm90 == runner_up for c in chosen)
    assert f"failed: {bad} (test tests/test_cuda.py::" in summary


def test_a_tile_the_sanitizer_flags_is_left_out_too(tmp_path, monkeypatch):
    bad = TILES[0]
    machine = FakeMachine(outputs={f"sanitizer racecheck {bad}": "========= ERROR SUMMARY: 2 errors\n"},
                          fastest_tile=bad)
    code, summary, _, table = lease(tmp_path, monkeypatch, machine)
    assert code == 1 and verdict_rows(summary)["sanitizer"] == FAIL
    assert f"racecheck {bad}: 2 errors" in summary
    assert all(bad not in (c.default, c.sm90) for c in kernel_table.read(str(table)).choices)


def test_a_failure_of_the_default_kernels_withholds_every_tile(tmp_path, monkeypatch):
    failing = ("==== short test summary info ====\nFAILED tests/test_cuda.py::test_x[default-torch] - x\n"
               "1 failed, 1199 passed in 95.1s\n")
    code, summary, _, table = lease(tmp_path, monkeypatch, FakeMachine(outputs={"gpu_tests": failing}))
    chosen = kernel_table.read(str(table)).choices
    assert all(c.default == kernel_table.SM80 for c in chosen)  # only the 2.x kernels can be the default
    source = tmp_path / "source.def"
    source.write_text(SOURCE_TABLE)
    assert [c.sm90 for c in chosen] == [c.sm90 for c in kernel_table.read(str(source)).choices]  # no tile passed


def test_a_run_cut_by_its_deadline_keeps_the_priority_order_and_changes_nothing(tmp_path, monkeypatch):
    # Every step slow: each ends at its limit, what is left of the deadline shrinks, the
    # benchmark's sweep is cut, its later commands and the decision get no time at all.
    slow = {"pip": 55.0, "environment_report.py": 40.0, "gpu_tests": 1000.0, "jax_capture_check.py": 100.0,
            "capture_check.py": 100.0, "tile_sweep.py": 1000.0,
            **{f"sanitizer {t} {p}": 200.0 for t in steps.SANITIZER_TOOLS for p in ("sm80", *TILES, steps.LAYER_PART)}}
    machine = FakeMachine(seconds=slow)
    code, summary, _, table = lease(tmp_path, monkeypatch, machine)
    rows = verdict_rows(summary)
    assert code == 1 and list(rows) == list(steps.RUNS["check"])  # every step has its verdict, in order
    assert rows["install"] == PASS and rows["environment"] == PASS
    assert rows["gpu_tests"] == FAIL and "timed out after 180 s (limit 180 s)" in summary
    assert rows["sanitizer"] == FAIL and rows["capture"] == FAIL
    assert rows["bench"] == FAIL and "frameworks: out of time" in summary and "fp8: out of time" in summary
    assert "bench.py" not in machine.seen and "fp8_bench.py" not in machine.seen
    assert rows["decision"] == SKIP and "out of time" in summary
    assert machine.now <= steps.DEADLINE["check"] - steps.SUMMARY_RESERVE_S
    assert table.read_text() == SOURCE_TABLE  # nothing decided: the table as it was


def test_a_failed_install_skips_what_needs_it(tmp_path, monkeypatch):
    machine = FakeMachine(outputs={"pip": "ERROR: groupgemm-...whl is not a supported wheel on this platform.\n"
                                          "RESULT: FAIL\n"})
    code, summary, _, _ = lease(tmp_path, monkeypatch, machine)
    rows = verdict_rows(summary)
    assert rows["install"] == FAIL and "is not a supported wheel" in summary
    assert all(rows[name] == SKIP for name in steps.RUNS["check"][1:]) and machine.seen == ["pip"]


def test_the_extra_run_profiles_runs_the_rest_of_the_suite_and_times_the_transformers_cells(tmp_path, monkeypatch):
    machine = FakeMachine()
    code, summary, out, _ = lease(tmp_path, monkeypatch, machine, run="extra")
    rows = verdict_rows(summary)
    assert code == 0 and list(rows) == list(steps.RUNS["extra"]) and set(rows.values()) == {PASS}
    assert machine.seen == ["pip", "environment_report.py", "profile_shape.py", "profile_shape.py",
                            "expert_mlp_fused.py", "suite", "transformers_experts.py"]
    assert ("| fused | PASS | 1 | 8 of 8 cells; fused / composed time: torch qwen3-30b-a3b/2 default 0.80, "
            "torch qwen3-30b-a3b/2 sm90 0.80,") in summary
    assert "## The fused expert MLP against its composition" in summary and " on NVIDIA H200;" in summary
    assert "| torch | qwen3-30b-a3b/2 | bfloat16 | sm90 | 3.0 / 10.0 (0.30) | 5.0 / 10.0 (0.50) | 8.0 / 10.0 (0.80) " \
        "| ok (4e-03) |" in summary
    assert "| jax | small-F | bfloat16 | default | 3.0 / 10.0 (0.30) | not measured | 8.0 / 10.0 (0.80) " in summary
    # Read back from the benchmark's JSON: the verdict's digest and the summary's table.
    assert ("| transformers | PASS | 1 | 7 of 7 cells; fastest built-in / groupgemm: forward 0.90x, "
            "forward+backward 0.90x, decode forward 0.90x |") in summary
    assert "## transformers 5.23.0 experts implementations" in summary
    assert ("Qwen3MoeExperts (hidden 2048, moe_intermediate 768, experts 128, top_k 8) on NVIDIA H100 80GB "
            "HBM3") in summary
    assert "| bfloat16 | forward+backward | 16384 | 2.00 | 0.90 | n/a | 20.00 | 0.90 |" in summary
    assert "| bfloat16 | decode forward | 32 | 2.00 | 0.90 | 1.50 | 20.00 | 0.90 |" in summary
    assert {results_dir.TRANSFORMERS_JSON, results_dir.FUSED_JSON} <= set(os.listdir(out))
    assert set(os.listdir(out)) <= set(results_dir.files("extra"))
    assert results_dir.budget_problems(str(out)) == []


def test_a_deadline_cut_transformers_run_reports_the_cells_it_finished(tmp_path, monkeypatch):
    # The profile and the suite slow: the deadline leaves the cells 57 s of their 90; the
    # benchmark, slower still, is stopped after its first 3 cells. The steps before keep
    # their verdicts.
    machine = FakeMachine(seconds={"profile_shape.py": 55.0, "suite": 60.0, "transformers_experts.py": 1000.0},
                          transformers_rows=canned_transformers_rows(TRANSFORMERS_CELLS[:3]))
    code, summary, out, _ = lease(tmp_path, monkeypatch, machine, run="extra")
    rows = verdict_rows(summary)
    assert code == 1 and {rows[name] for name in steps.RUNS["extra"][:-1]} == {PASS}
    assert rows["transformers"] == INCOMPLETE
    assert "timed out after 57 s (limit 57 s); 3 of 7 cells; fastest built-in / groupgemm: forward 0.90x, " \
           "forward+backward 0.90x" in summary
    assert machine.now <= steps.DEADLINE["extra"] - steps.SUMMARY_RESERVE_S
    assert "| bfloat16 | forward+backward | 4096 |" in summary and "| decode forward |" not in summary


def test_the_transformers_cells_are_skipped_when_the_steps_before_take_the_deadline(tmp_path, monkeypatch):
    machine = FakeMachine(seconds={"profile_shape.py": 55.0, "suite": 1000.0})
    code, summary, _, _ = lease(tmp_path, monkeypatch, machine, run="extra")
    rows = verdict_rows(summary)
    assert rows["profile"] == PASS and rows["suite"] == FAIL  # the suite ran to its own limit
    assert rows["transformers"] == SKIP and "out of time (7 s left of the deadline)" in summary
    assert "transformers_experts.py" not in machine.seen and "## transformers" not in summary


def test_a_transformers_cell_that_disagrees_with_eager_fails_that_step_only(tmp_path, monkeypatch):
    wrong = TRANSFORMERS_CELLS[1]
    machine = FakeMachine(returncodes={"transformers_experts.py": 1},
                          transformers_rows=canned_transformers_rows(wrong=wrong))
    code, summary, _, _ = lease(tmp_path, monkeypatch, machine, run="extra")
    rows = verdict_rows(summary)
    assert code == 1 and rows["transformers"] == FAIL and {rows[n] for n in steps.RUNS["extra"][:-1]} == {PASS}
    assert f"grouped_mm {wrong[1]} T={wrong[2]}: disagrees with eager; 7 of 7 cells" in summary


def test_the_fused_step_runs_the_benchmark_at_qwen3_widths_in_bfloat16_under_each_kernel_choice(tmp_path):
    pytest.importorskip("numpy")
    import expert_mlp_fused

    for hopper, kernels in ((True, ["default", "sm90"]), (False, ["default"])):
        ctx = kit.context(kit.parse_args(["extra", "--out", str(tmp_path)]), hopper_facts(tmp_path))
        ctx.hopper = hopper
        (command,) = steps.commands("fused", ctx)
        args = expert_mlp_fused.parse_args(command.argv[2:])  # the benchmark's own reading of it
        assert (args.device, args.dtype, args.kernels, args.scale) == ("cuda", ["bfloat16"], kernels, 2)
        assert expert_mlp_fused.dims("qwen3-30b-a3b/2", args.scale) == dict(tokens=8192, hidden=2048, ffn=768,
                                                                             experts=16, top_k=4)
        assert args.json == os.path.join(str(tmp_path), results_dir.FUSED_JSON)
        assert len(expert_mlp_report.planned_cells(args.frameworks, args.shapes, args.dtype, args.kernels)) == \
            4 * len(kernels)


def test_a_fused_cell_that_disagrees_fails_that_step_only(tmp_path, monkeypatch):
    wrong = FUSED_CELLS[5]
    machine = FakeMachine(returncodes={"expert_mlp_fused.py": 1}, fused_rows=canned_fused_rows(wrong=wrong))
    code, summary, _, _ = lease(tmp_path, monkeypatch, machine, run="extra")
    rows = verdict_rows(summary)
    assert code == 1 and rows["fused"] == FAIL and {rows[n] for n in steps.RUNS["extra"] if n != "fused"} == {PASS}
    assert f"{' '.join(wrong)}: fused and composed disagree (5.0e-01); 8 of 8 cells" in summary


def test_a_fused_run_stopped_at_its_limit_reports_the_cells_it_finished(tmp_path, monkeypatch):
    machine = FakeMachine(seconds={"expert_mlp_fused.py": 1000.0}, fused_rows=canned_fused_rows(FUSED_CELLS[:3]))
    code, summary, _, _ = lease(tmp_path, monkeypatch, machine, run="extra")
    rows = verdict_rows(summary)
    assert rows["fused"] == INCOMPLETE and rows["suite"] == PASS
    assert "timed out after 45 s (limit 45 s); 3 of 8 cells; fused / composed time: torch qwen3-30b-a3b/2 default " \
           "0.80, torch qwen3-30b-a3b/2 sm90 0.80, torch small-F default 0.80" in summary


def test_a_transformers_run_that_wrote_nothing_fails_without_an_earlier_runs_cells(tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    stale = tmp_path / "out" / results_dir.TRANSFORMERS_JSON  # an earlier run's, in the same folder
    stale.write_text(json.dumps({"results": canned_transformers_rows()}))
    machine = FakeMachine(outputs={"transformers_experts.py": "ModuleNotFoundError: No module named 'regex'\n"},
                          returncodes={"transformers_experts.py": 1}, transformers_rows=None)
    code, summary, out, _ = lease(tmp_path, monkeypatch, machine, run="extra")
    assert verdict_rows(summary)["transformers"] == FAIL
    assert "exited 1: ModuleNotFoundError: No module named 'regex'; 0 of 7 cells |" in summary
    assert not stale.exists() and "## transformers" not in summary


def test_without_a_gpu_the_gpu_steps_are_skipped_with_the_reason(tmp_path, monkeypatch):
    facts = hopper_facts(tmp_path, sanitizer="", ncu="")
    facts.gpus = []
    code, summary, _, _ = lease(tmp_path, monkeypatch, FakeMachine(), facts=facts)
    rows = verdict_rows(summary)
    assert rows["install"] == PASS and rows["gpu_tests"] == SKIP and "no CUDA GPU" in summary


def test_the_suite_and_the_command_runner_stop_at_their_limit(tmp_path):
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_fails():\n    assert 1 == 2\n\ndef test_slow():\n    time.sleep(300)\n")
    # The limit leaves a loaded machine time to start pytest and report the first test. As
    # in the kit's steps, Python's output is unbuffered: a pipe would otherwise hold the
    # summary until the process exits. Its temporary files stay in its own folder: pytest's
    # shared one gets old sessions' folders deleted at exit, which can outlast the grace.
    with open(tmp_path / "log", "w") as log:
        done = runner.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                           str(tmp_path / "base"), "test_slow.py"], log, timeout=20,
                          env_changes={"PYTHONUNBUFFERED": "1"}, cwd=str(tmp_path))
    assert done.timed_out and done.seconds < 60
    status, reason = verdicts.pytest_verdict(done.output, done.returncode)
    assert status == FAIL, done.output[-3000:]
    # SIGINT lets pytest write its summary; on a starved machine it may not manage within
    # the grace, and SIGTERM (-15) ends it without one, still a FAIL.
    if done.returncode != -signal.SIGTERM:
        assert reason == "1 failed; first: test_slow.py::test_fails", done.output[-3000:]
    with open(tmp_path / "log", "w") as log:
        done = runner.run([sys.executable, "-c", "print('started', flush=True); import time; time.sleep(60)"],
                          log, timeout=1)
    assert done.timed_out and done.returncode != 0 and done.seconds < 30
    assert "started" in done.output and "stopped after" in (tmp_path / "log").read_text()


def test_commands_side_by_side_each_log_their_output_whole(tmp_path):
    args = kit.parse_args(["--out", str(tmp_path)])
    with open(tmp_path / "log", "w") as log:
        run = kit.Run(args, hopper_facts(tmp_path, cpus=4), log)
        commands = [steps.Command([sys.executable, "-c", f"print('{i}' * 3); print('{i}' * 4)"], {}, str(i))
                    for i in range(3)]
        done = run.execute_all(commands, 60)
    assert [d.output.split() for d in done] == [["000", "0000"], ["111", "1111"], ["222", "2222"]]
    text = (tmp_path / "log").read_text()
    assert text.index("000\n0000") < text.index("111\n1111") < text.index("222\n2222")


# ---- the kernel table --------------------------------------------------------------------------

def test_the_kernel_table_reads_and_rewrites_its_choices_in_place(tmp_path):
    path = tmp_path / "table.def"
    original = open(kernel_table.TABLE).read()
    path.write_text(original)
    table = kernel_table.read(str(path))
    assert table.tile_names and table.choices[-1].smaller_side_at_most == 0
    new = tuple(kernel_table.Choice(c.smaller_side_at_most, table.tile_names[0], table.tile_names[-1])
                for c in table.choices)
    written = kernel_table.write_choices(new, "a test, with a long reason " * 6, str(path))
    assert written.choices == new and written.tiles == table.tiles and written.chosen_by.startswith("a test")
    text = path.read_text()
    assert all(len(line) <= 100 for line in text.splitlines())
    tile_lines = [line for line in original.splitlines() if line.startswith("GG_SM90_TILE(")]
    assert [line for line in text.splitlines() if line.startswith("GG_SM90_TILE(")] == tile_lines
    kernel_table.write_choices(table.choices, table.chosen_by, str(path))
    assert path.read_text() == original  # a rewrite of the same choices is the same file


@pytest.mark.parametrize("bad, message", [
    ("GG_HOPPER_CHOICE(0, sm81, sm90_64x128)", "names a kernel the table does not have"),
    ("GG_HOPPER_CHOICE(0, sm80 sm90_64x128)", "not a GG_HOPPER_CHOICE row"),
    ("GG_HOPPER_CHOICE(128, sm80, sm90_64x128)", "the last GG_HOPPER_CHOICE must take any size"),
])
def test_a_malformed_table_is_refused_naming_the_problem(tmp_path, bad, message):
    text = open(kernel_table.TABLE).read().splitlines()
    last = max(i for i, line in enumerate(text) if line.startswith("GG_HOPPER_CHOICE("))
    text[last] = bad
    path = tmp_path / "table.def"
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(ValueError, match=message):
        kernel_table.read(str(path))


def test_the_decision_takes_per_class_the_fastest_kernel_that_passed():
    table = kernel_table.read()
    small, large = table.choices[0].smaller_side_at_most, 4 * max(table.choices[0].smaller_side_at_most, 64)
    a, b = table.tile_names[:2]
    timings = [kernel_table.Timing("small", small, "sm80", 3e-3), kernel_table.Timing("small", small, a, 2e-3),
               kernel_table.Timing("small", small, b, 1e-3),
               kernel_table.Timing("large", large, "sm80", 1e-3), kernel_table.Timing("large", large, a, 2e-3),
               kernel_table.Timing("large", large, b, 4e-3)]
    choices, reasons = kernel_table.decide(table, timings, {"sm80", a, b})
    assert (choices[0].default, choices[0].sm90) == (b, b)
    assert (choices[-1].default, choices[-1].sm90) == ("sm80", a)  # sm80 competes for the default only
    assert "sm80 1.000 ms" in reasons[0]
    choices, _ = kernel_table.decide(table, timings, {"sm80", a})  # b failed: it does not compete
    assert (choices[0].default, choices[0].sm90) == (a, a)
    choices, reasons = kernel_table.decide(table, timings, {"sm80"})  # no tile passed
    assert choices == table.choices and "no sm90 tile passed" in reasons[table.choices[0].smaller_side_at_most]
    assert kernel_table.decide(table, [], {"sm80", a, b})[0] == table.choices  # nothing measured: unchanged


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


# ---- the fused expert MLP's calls of the sanitizer driver ----------------------------------

def test_the_quick_fused_mlp_cases_reach_every_fused_kernel():
    import expert_mlp_driver

    def reached(names, family="default"):
        found = set()
        for name in names:
            for _, kernels in expert_mlp_driver.planned_mlp_calls(expert_mlp_driver.ALL_MLP_CASES[name], family):
                found |= kernels
        return found

    required = driver_calls.required_expert_mlp_kernels()
    # 4 kernels of any dtype (route, setup, fill, idle), 5 per dtype (h, activation, bias
    # sums, the backward rows for 1 or 2 probs dtypes); gathered GEMMs: float32 4, each
    # 16-bit dtype 6 on tensor cores and 4 unaligned.
    assert len(required) == 4 + 3 * 3 + 1 + 2 + 2 + 4 + 2 * (6 + 4)
    assert required == reached(expert_mlp_driver.QUICK_MLP_CASES) == reached(expert_mlp_driver.ALL_MLP_CASES)
    aligned = reached(["tiles"])
    assert {k[0] for k in required - aligned if isinstance(k, tuple)} == {driver_calls.GATHERED_UNALIGNED}
    # On Hopper the driver runs them again under "sm90": the aligned 16-bit gathered GEMMs go
    # through the sm_90a gathered GEMM, 2 dtypes x (2 outputs x 2 layouts + the contraction
    # gathered in A or in B) more to reach.
    hopper = driver_calls.required_expert_mlp_kernels(driver_calls.MLP_FAMILIES)
    assert {k[0] for k in hopper - required} == {driver_calls.GATHERED_SM90} and len(hopper - required) == 12
    assert hopper == required | reached(expert_mlp_driver.QUICK_MLP_CASES, "sm90")


def test_the_fused_mlp_checks_pass_on_the_cpu_backend_and_catch_wrong_results():
    torch = pytest.importorskip("torch")
    import expert_mlp_driver as mlp
    import numpy as np
    import sanitizer_driver as driver

    from groupgemm import _core

    cpu = driver.Device(torch, _core, "cpu")
    for name in ("tiles", "zero_ffn", "all_dropped"):
        case = mlp.ALL_MLP_CASES[name]
        for call, _ in mlp.planned_mlp_calls(case)[:2]:
            assert [p for _, p in mlp.run_mlp_call(cpu, cpu, case, call, mlp.mlp_inputs(case, call), "nan") if p] == []
    case = mlp.ALL_MLP_CASES["tiles"]
    call = mlp.planned_mlp_calls(case)[0][0]
    x = mlp.mlp_inputs(case, call)
    want = torch.ones(4, 3)
    assert "max error" in mlp.mismatch("dw_in", "float32", want + 1e-3, want, None)
    zeros = np.zeros((4, 3), bool)
    zeros[1] = True
    assert "exact zeros" in mlp.mismatch("dw_in", "float32", want, want, zeros)
    assert mlp.mismatch("dw_in", "float32", want, want, None) is None
    assert mlp._exact_zeros(case, call, x)["dw_in"][2].all()  # global id 3 (local 2) is never chosen
