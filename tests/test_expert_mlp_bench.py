"""The fused expert MLP benchmark runs end to end on a tiny shape in both frameworks: each
quantity measured for both variants, the two variants checked against each other."""

import json
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "expert_mlp_fused.py")


def test_expert_mlp_bench_measures_memory_and_time_of_both_variants(tmp_path):
    out = tmp_path / "expert_mlp_fused.json"
    proc = subprocess.run(
        [sys.executable, BENCH, "--shapes", "small-F", "hot-expert", "--dtype", "float32", "--scale", "0.1",
         "--repeats", "1", "--budget", "0.1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert {r["framework"] for r in rows} == {"torch", "jax"}
    for r in rows:
        assert r["check"] == "ok", r
        for quantity in ("saved_bytes", "peak_bytes", "ms"):
            assert r[f"fused_{quantity}"] > 0 and r[f"composed_{quantity}"] > 0, (quantity, r)
        assert r["saved_bytes_ratio"] < 1  # a gradient keeps less, whatever the shape
    assert "| jax | small-F | float32 |" in proc.stdout and "| torch | hot-expert | float32 |" in proc.stdout
    hot = next(r for r in rows if r["shape"] == "hot-expert")
    assert hot["idle_experts"] == 0 and hot["top_k"] == 1
