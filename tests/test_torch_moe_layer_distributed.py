"""An expert-parallel MoE layer of permute, GroupedMLP and unpermute over gloo, with ranks
that have no tokens and a rank that receives none, trains like one process."""

import os

import moe_layer_worker as worker
import pytest
import torch
from workers import run_worker


@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_moe_layer_with_zero_token_ranks_matches_single_process(world, tmp_path):
    run_worker(os.path.join(os.path.dirname(__file__), "moe_layer_worker.py"), world, tmp_path, timeout=120)
    saved = [torch.load(tmp_path / f"params{rank}.pt") for rank in range(world)]

    # The cases the layer must survive did happen: rank 1 had no tokens on odd steps, on
    # step 2 it received no rows, and some slots were dropped by the router.
    traffic = [s["traffic"] for s in saved]
    assert [traffic[1][step]["tokens"] for step in (1, 3)] == [0, 0]
    assert traffic[1][2]["received"] == 0 and traffic[1][0]["received"] > 0
    assert sum(t["dropped"] for rank in traffic for t in rank) > 0

    reference = worker.single_process_reference(world)
    init = worker.init_params(world)
    for name in ("router", "fc1", "fc2"):
        assert not torch.allclose(reference[name], init[name])  # training moved every parameter
    for rank, got in enumerate(saved):
        local = slice(rank * worker.LOCAL_EXPERTS, (rank + 1) * worker.LOCAL_EXPERTS)
        assert not torch.allclose(got["fc1"], init["fc1"][local])
        torch.testing.assert_close(got["router"], reference["router"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["fc1"], reference["fc1"][local], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["fc2"], reference["fc2"][local], rtol=1e-5, atol=1e-6)
