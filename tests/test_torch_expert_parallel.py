"""Expert-parallel training across processes, with zero-token ranks, matches one process."""

import os

import ep_worker
import pytest
import torch
from workers import run_worker


@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_training_with_zero_token_ranks_matches_single_process(world, tmp_path):
    run_worker(os.path.join(os.path.dirname(__file__), "helpers", "ep_worker.py"), world, tmp_path)
    reference = ep_worker.single_process_reference(world)
    assert not torch.equal(reference["w1"], ep_worker.init_params(world)["w1"])  # training moved the experts
    for rank in range(world):
        got = torch.load(tmp_path / f"params{rank}.pt")
        local = slice(rank * ep_worker.LOCAL_EXPERTS, (rank + 1) * ep_worker.LOCAL_EXPERTS)
        torch.testing.assert_close(got["router"], reference["router"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["w1"], reference["w1"][local], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["w2"], reference["w2"][local], rtol=1e-5, atol=1e-6)
