"""DDP with a rank that has zero tokens completes and averages the right gradients, with the
experts' GEMMs in 16-bit and in FP8."""

import os

import ddp_worker
import pytest
import torch
from workers import run_worker


@pytest.mark.parametrize("fp8", [None, "blockwise"])
def test_ddp_step_with_a_zero_token_rank_matches_single_process(tmp_path, fp8):
    worker = os.path.join(os.path.dirname(__file__), "helpers", "ddp_worker.py")
    run_worker(worker, tmp_path, *([fp8] if fp8 else []))
    ranks = [torch.load(tmp_path / f"grads{r}.pt") for r in range(ddp_worker.WORLD)]

    model = ddp_worker.make_block(fp8)  # one process on the union of the batches
    union = torch.cat([ddp_worker.batch(r, fp8) for r in range(ddp_worker.WORLD)])
    ddp_worker.loss_fn(model(union)).backward()
    for name, p in model.named_parameters():
        for grads in ranks:
            assert grads[name] is not None and grads[name].shape == p.shape
            # DDP averages over ranks: the zero-token rank contributes exact zeros.
            torch.testing.assert_close(grads[name] * ddp_worker.WORLD, p.grad, rtol=1e-6, atol=1e-7)
