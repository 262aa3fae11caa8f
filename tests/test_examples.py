"""The README's main job: the MoE demo runs, both frameworks agree, the plot is written."""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from moe_dispatch import sort_by_expert

DEMO = os.path.join(os.path.dirname(__file__), "..", "examples", "moe_demo.py")


def test_moe_demo_trains_in_both_frameworks_and_writes_the_plot(tmp_path):
    plot = tmp_path / "loss.png"
    result = subprocess.run([sys.executable, DEMO, "--steps", "8", "--plot", str(plot)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every expert on rank 1 idle" in result.stdout
    assert plot.exists() and plot.stat().st_size > 0


def test_moe_demo_trains_with_fp8_experts_in_both_frameworks(tmp_path):
    # The exact-zero gradients of experts without tokens are asserted by the demo itself.
    result = subprocess.run([sys.executable, DEMO, "--steps", "8", "--experts", "fp8-blockwise", "--plot",
                             str(tmp_path / "loss.png")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "experts in fp8-blockwise" in result.stdout and "every expert on rank 1 idle" in result.stdout


@pytest.mark.parametrize("dtype", ["int16", "int32", "int64", "uint8"])
def test_sort_by_expert_takes_every_integer_dtype_as_jax_does(dtype):
    # PyTorch's route (softmax_topk) gives int32 ids; the torch branch once took int64 only.
    ids = np.array([2, 0, 5, 1, 2, 1, 0, 3], dtype)
    want_order = np.argsort(np.where(ids < 4, ids, 4), kind="stable")
    want_sizes = np.bincount(ids[ids < 4], minlength=4)
    for order, sizes in (sort_by_expert(torch.from_numpy(ids), 4), sort_by_expert(jnp.asarray(ids), 4)):
        assert np.array_equal(np.asarray(order), want_order) and np.array_equal(np.asarray(sizes), want_sizes)
