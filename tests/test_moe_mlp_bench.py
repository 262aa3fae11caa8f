"""The expert-MLP benchmark runs end to end on tiny shapes, every contender checked and timed."""

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "moe_mlp.py")
CONTENDERS = {"groupgemm", "per-expert loop", "torch._grouped_mm"}


def test_moe_mlp_bench_times_and_checks_every_contender(tmp_path):
    out = tmp_path / "moe_mlp.json"
    proc = subprocess.run(
        [sys.executable, BENCH, "--tokens", "64", "--hidden", "32", "--ffn", "32", "--experts", "4",
         "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    configs = {(r["dtype"], r["routing"]) for r in rows}
    assert configs == {(d, r) for d in ("bfloat16", "float32") for r in ("uniform", "skewed-some-empty")}
    for config in configs:
        got = [r for r in rows if (r["dtype"], r["routing"]) == config]
        assert {r["impl"] for r in got} == CONTENDERS, config
        for r in got:
            assert "error" not in r and r["check"] == "ok", r
            assert r["fwd_bwd_ms"] > 0 and r["vs_groupgemm"] > 0
    assert any(r["empty_experts"] > 0 for r in rows)  # the skewed routing leaves experts empty
    assert "| torch._grouped_mm |" in proc.stdout
