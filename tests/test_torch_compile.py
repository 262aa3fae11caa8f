"""torch.compile(fullgraph=True) of an MoE block built on GroupedLinear."""

import pytest
import torch
from moe_torch import MoEBlock


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_moe_block_matches_eager_forward_and_backward(dynamic):
    torch.manual_seed(0)
    block = MoEBlock(dim=16, ffn=32, experts=4, top_k=2)
    mask = torch.tensor([True, False, True, True])  # expert 1 gets no tokens
    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)
    for tokens in (12, 20):  # a second shape: recompiles when static, reuses when dynamic
        x = torch.randn(tokens, 16)
        eager_out = block(x, mask)
        eager_grads = torch.autograd.grad(eager_out.square().sum(), list(block.parameters()))
        out = compiled(x, mask)
        grads = torch.autograd.grad(out.square().sum(), list(block.parameters()))
        torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
        for g, e in zip(grads, eager_grads):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        assert (grads[1][1] == 0).all()  # up.weight of the expert without tokens
