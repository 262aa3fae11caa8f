"""The transformers experts benchmark runs end to end on a tiny shape: every implementation
checked against eager and timed in every cell, batched_mm's weight gather reported where it
would exceed the limit."""

import json
import os
import subprocess
import sys

from clients import require

require("transformers.integrations.moe")

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "transformers_experts.py")
IMPLEMENTATIONS = {"groupgemm", "grouped_mm", "batched_mm", "eager"}


def test_transformers_experts_bench_checks_and_times_every_implementation(tmp_path):
    out = tmp_path / "transformers_experts.json"
    # Widths 2048 / 32 and 768 / 32, 8 experts, top-2; batched_mm may gather 0.5 MB: the
    # 16-token cells' 32 slots need 0.6 MB, the decode cell's 2 slots 37 KB.
    proc = subprocess.run(
        [sys.executable, BENCH, "--scale", "32", "--experts", "8", "--top-k", "2", "--train-tokens", "16",
         "--decode-tokens", "1", "--dtype", "float32", "--repeats", "1", "--decode-repeats", "1", "--budget", "0.1",
         "--max-gather-gb", "0.0005", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    cells = {(r["phase"], r["tokens"]) for r in rows}
    assert cells == {("forward", 16), ("forward+backward", 16), ("decode forward", 1)}
    for cell in cells:
        got = {r["impl"]: r for r in rows if (r["phase"], r["tokens"]) == cell}
        assert set(got) == IMPLEMENTATIONS, cell
        for name, r in got.items():
            if name == "batched_mm" and cell[1] == 16:
                assert r["error"].startswith("not run: would gather"), r
                continue
            assert "error" not in r and r["check"] == "ok", r
            assert r["ms"] > 0 and r["vs_groupgemm"] > 0
    assert "| float32 | decode forward | 1 |" in proc.stdout
