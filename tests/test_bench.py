"""The benchmark CLI runs end to end on tiny shapes and checks what it times."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench.py")
ROUTINGS = ["uniform", "skewed", "some-empty", "skewed-some-empty", "all-empty"]
DENSE = {"dense GEMM", "groupgemm dense (one group)"}
IMPLS = {"jax": {"groupgemm", "jax.lax.ragged_dot", "per-expert loop", *DENSE},
         "torch": {"groupgemm", "torch._grouped_mm", "per-expert loop", *DENSE}}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the CLI runs as users run it: one CPU device
    proc = subprocess.run(
        [sys.executable, BENCH, "--tokens", "64", "--hidden", "32", "--ffn", "32", "--experts", "4",
         "--dtype", "float32", "bfloat16", "--routing", *ROUTINGS, "--repeats", "1",
         "--overhead-repeats", "20", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout


def test_bench_writes_csv_json_and_png(bench_run):
    out, _ = bench_run
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(open(out / "bench.csv")))
    document = json.load(open(out / "bench.json"))
    assert len(rows) == len(document["results"]) == 2 * 5 * 2 * 5  # dtypes x routings x frameworks x impls
    for framework, impls in IMPLS.items():
        for dtype in ("float32", "bfloat16"):
            for routing in ROUTINGS:
                got = {r["impl"] for r in rows
                       if (r["framework"], r["dtype"], r["routing"]) == (framework, dtype, routing)}
                assert got == impls, (framework, dtype, routing)
    assert {r["framework"] for r in document["overhead"]} == {"jax", "torch"}
    assert all(r["median_us"] > 0 for r in document["overhead"])


def test_bench_checks_groupgemm_results_against_the_reference(bench_run):
    out, _ = bench_run
    rows = list(csv.DictReader(open(out / "bench.csv")))
    groupgemm = [r for r in rows if r["impl"] == "groupgemm"]
    assert len(groupgemm) == 20
    for r in groupgemm:
        assert r["check"] == "ok" and r["error"] == "", r
        assert float(r["fwd_ms"]) > 0 and float(r["fwd_bwd_ms"]) > 0
    loops = [r for r in rows if r["impl"] == "per-expert loop"]
    assert all(r["check"] == "ok" for r in loops)  # the reference itself is sane


def test_bench_reports_no_flops_or_dense_ratio_when_every_expert_is_empty(bench_run):
    out, _ = bench_run
    for r in csv.DictReader(open(out / "bench.csv")):
        if r["routing"] == "all-empty":
            assert r["fwd_gflops"] == r["fwd_vs_dense"] == r["fwd_vs_groupgemm_dense"] == "", r
        else:
            assert float(r["fwd_gflops"]) > 0 and float(r["fwd_vs_dense"]) > 0
            assert float(r["fwd_vs_groupgemm_dense"]) > 0


def test_bench_prints_groupgemm_against_each_contender(bench_run):
    _, stdout = bench_run
    summary = stdout.split("torch, cpu: groupgemm against each contender")[1]
    head = next(line for line in summary.splitlines() if line.startswith("| dtype"))
    assert "speed-up over torch._grouped_mm" in head and "speed-up over per-expert loop" in head
    assert "vs groupgemm dense" in head
    assert summary.count("| bfloat16 | 4 | skewed-some-empty |") == 1


def test_bench_reports_cpu_peak_memory_as_not_measured(bench_run):
    out, stdout = bench_run
    assert all(r["peak_mb"] == "" for r in csv.DictReader(open(out / "bench.csv")))
    assert "| groupgemm |" in stdout and "n/a" in stdout


@pytest.fixture
def bench_modules(monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(BENCH))
    import bench
    import problem
    return bench, problem


def test_check_rejects_wrong_and_uninitialised_results(bench_modules):
    _, problem = bench_modules
    p = problem.Problem.draw(problem.Config("float32", 4, 64, 32, 32, "some-empty"))
    right = [p.reference[name].copy() for name in ("out", "dlhs", "drhs")]
    assert problem.check(p, right)[0]
    off_by_one = [r.copy() for r in right]
    off_by_one[2][0, 0, 0] += 1.0
    assert problem.check(p, off_by_one)[0::2] == (False, "drhs")
    garbage = [r.copy() for r in right]
    garbage[1][-1] = np.nan  # a row a kernel left uninitialised
    passed, error, worst = problem.check(p, garbage)
    assert not passed and error == float("inf") and worst == "dlhs"
    short = [right[0], right[1], right[2][:, :, :-1]]  # a column short
    assert problem.check(p, short) == (False, float("inf"), "drhs")


@pytest.mark.parametrize("routing", ["skewed-some-empty", "all-empty"])
def test_sampled_check_covers_group_edges_and_agrees_with_the_full_reference(bench_modules, monkeypatch, routing):
    _, problem = bench_modules
    monkeypatch.setattr(problem, "FULL_REFERENCE_FLOPS", 0.0)  # sample even this small problem
    monkeypatch.setattr(problem, "SAMPLED_ROWS", 8)
    monkeypatch.setattr(problem, "SAMPLED_COLUMNS", 5)
    config = problem.Config("float32", 8, 300, 40, 24, routing)
    p = problem.Problem.draw(config)
    rows, k_cols, n_cols = p.sample
    assert len(rows) < config.tokens and len(k_cols) == 5 and len(n_cols) == 5
    full = problem._reference(p.lhs, p.rhs, p.dout, config.sizes)  # every element
    right = [full[name] for name in ("out", "dlhs", "drhs")]
    assert problem.check(p, right)[0]
    for name, sampled in p.reference.items():  # the sample is the full reference's part
        np.testing.assert_allclose(sampled, problem._sampled(name, full[name], p.sample), rtol=1e-5, atol=1e-5)
    # Every group's last row is checked (where an off-by-one in a row range shows), and
    # an uninitialised value there fails the check.
    last_rows = [stop - 1 for start, stop in problem._group_rows(config.sizes, config.tokens) if stop > start]
    last_rows = last_rows or [config.tokens - 1]  # all-empty: the padding's last row
    assert set(last_rows) <= set(rows.tolist())
    for row in last_rows:
        garbage = [r.copy() for r in right]
        garbage[0][row, n_cols[-1]] = np.nan
        assert problem.check(p, garbage)[0::2] == (False, "out")


def test_inputs_are_the_same_whatever_the_thread_count(bench_modules, monkeypatch):
    _, problem = bench_modules
    config = problem.Config("bfloat16", 4, 64, 32, 48, "uniform")
    monkeypatch.setattr(problem, "DRAW_CHUNK", 1000)  # several chunks, drawn concurrently
    many = problem.Problem.draw(config)
    monkeypatch.setattr(problem.os, "cpu_count", lambda: 1)
    one = problem.Problem.draw(config)
    for a, b in ((many.lhs, one.lhs), (many.rhs, one.rhs), (many.dout, one.dout)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert np.isfinite(many.rhs.astype(np.float32)).all() and len(np.unique(many.rhs)) > 100


def test_bench_exits_nonzero_when_a_groupgemm_check_fails(bench_modules, monkeypatch, tmp_path):
    bench, _ = bench_modules
    monkeypatch.setattr(bench, "check", lambda problem, results: (False, 1.0, "out"))
    argv = ["--frameworks", "torch", "--tokens", "32", "--hidden", "16", "--ffn", "16", "--experts", "2",
            "--repeats", "1", "--overhead-repeats", "2", "--out", str(tmp_path)]
    assert bench.main(argv) == 1


def test_hopper_target_judges_each_groupgemm_kernel_in_both_frameworks(bench_modules):
    import report
    from contenders import DENSE, GROUPED_MM, GROUPGEMM, PER_EXPERT_LOOP, family_contender

    def row(experts, impl, fwd_bwd_ms, framework="torch", **extra):
        return {"framework": framework, "device": "cuda", "dtype": "bfloat16", "experts": experts, "tokens": 4096,
                "hidden": 2048, "ffn": 1408, "routing": "uniform", "impl": impl, "fwd_bwd_ms": fwd_bwd_ms,
                "check": "ok" if impl not in (DENSE, GROUPED_MM) else "", **extra}

    by_shape, tile, sm80 = map(family_contender, ("sm90", "sm90_64x128", "sm80"))
    rows = [row(8, DENSE, 1.0), row(8, GROUPED_MM, 1.5), row(8, PER_EXPERT_LOOP, 9.0),
            row(8, GROUPGEMM, 1.6), row(8, by_shape, 1.2), row(8, tile, 1.5),  # 1.5 / 1.2 = 1.25x; 1.0x
            row(8, sm80, 0.9, check="failed"),  # fast but wrong: not met
            row(8, GROUPGEMM, 1.4, framework="jax"),  # against torch's _grouped_mm at the same shape
            row(128, DENSE, 1.0), row(128, GROUPED_MM, 1.1), row(128, by_shape, 1.3),
            row(128, tile, None, check=None, error="RuntimeError: CUTLASS failed")]  # no time: not met
    judged = {(j["config"]["experts"], j["framework"], j["impl"]): j for j in report.target_rows(rows)}
    assert set(judged) == {(8, "torch", GROUPGEMM), (8, "torch", by_shape), (8, "torch", tile), (8, "torch", sm80),
                           (8, "jax", GROUPGEMM), (128, "torch", by_shape), (128, "torch", tile)}
    assert judged[8, "torch", by_shape]["met"] and judged[8, "torch", tile]["met"]  # 1.0x is enough
    assert not judged[8, "torch", GROUPGEMM]["met"]  # slower than torch._grouped_mm
    assert judged[8, "jax", GROUPGEMM]["met"] and judged[8, "jax", GROUPGEMM]["over_grouped_mm"] == 1.5 / 1.4
    assert not judged[8, "torch", sm80]["met"] and judged[8, "torch", sm80]["problem"] == "check: failed"
    assert not judged[128, "torch", by_shape]["met"] and not judged[128, "torch", tile]["met"]
    table = report.targets_table(rows)
    assert table.startswith(report.TARGETS_TITLE)
    assert "| bfloat16 | 8 | 4096,2048,1408 | uniform | torch | groupgemm sm90 | 1.2 | 0.83 | 1.25 | yes |" in table
    assert "| n/a | n/a | n/a | no (RuntimeError: CUTLASS failed) |" in table
    assert f"torch {by_shape}: met at 1 of 2 configurations" in table and f"jax {GROUPGEMM}: met at 1 of 1" in table
    # Off Hopper (no family rows, as on a CPU, where torch._grouped_mm runs too) there is no table.
    assert report.targets_table([r for r in rows if not r["impl"].startswith(f"{GROUPGEMM} ")]) == ""
    assert [r["impl"] for r in report.failed_checks(rows)] == [sm80, tile]


def test_fp8_benchmark_runs_and_checks_its_results_on_the_cpu():
    # The GPU kit's FP8 benchmark (benchmarks/fp8_bench.py), rehearsed on a tiny shape: it
    # checks the FP8 layers against the bfloat16 one before timing and ends with a verdict.
    script = os.path.join(os.path.dirname(BENCH), "fp8_bench.py")
    proc = subprocess.run([sys.executable, script, "--device", "cpu", "--shapes", "2,64,128,128", "--routing",
                           "skewed-some-empty", "--repeats", "1", "--budget", "0.1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| groupgemm fp8 blockwise forward+backward |" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("RESULT: PASS")


def test_the_dispatch_benchmark_checks_every_contender_and_reports_ratios():
    # benchmarks/ep_dispatch.py on a tiny shape: every contender's result equals the
    # hand-written dispatch's before timing, and one table gives each one's ratio to it.
    script = os.path.join(os.path.dirname(BENCH), "ep_dispatch.py")
    proc = subprocess.run([sys.executable, script, "--tokens", "32", "--hidden", "8", "--repeats", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| groupgemm", "| hand-written"))]
    assert len(rows) == 4 and rows[-1].endswith("| 1.00x |"), proc.stdout
