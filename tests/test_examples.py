"""The README's main job: the MoE demo runs, both frameworks agree, the plot is written."""

import os
import subprocess
import sys

DEMO = os.path.join(os.path.dirname(__file__), "..", "examples", "moe_demo.py")


def test_moe_demo_trains_in_both_frameworks_and_writes_the_plot(tmp_path):
    plot = tmp_path / "loss.png"
    result = subprocess.run([sys.executable, DEMO, "--steps", "8", "--plot", str(plot)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every expert on rank 1 idle" in result.stdout
    assert plot.exists() and plot.stat().st_size > 0
