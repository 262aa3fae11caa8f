"""torch.compile(fullgraph=True) of an MoE block built on GroupedLinear, and what torch.export
refuses to trace."""

import pytest
import torch
from compiles import counted_compile
from moe_torch import MoEBlock

import groupgemm.torch as gt


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_moe_block_matches_eager_forward_and_backward(dynamic):
    torch.manual_seed(0)
    block = MoEBlock(dim=16, ffn=32, experts=4, top_k=2)
    mask = torch.tensor([True, False, True, True])  # expert 1 gets no tokens
    compiled, counter = counted_compile(block, dynamic=dynamic)
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
    assert counter.frame_count == (1 if dynamic else 2)


def test_the_compile_count_sees_a_recompile_for_each_routing_held_as_python_ints():
    # A planted fault: group sizes held as Python ints are constants of the graph, so a new
    # routing makes a new graph; a count that claims one graph for every routing must fail.
    def first_group_sum(x, sizes):
        return torch.split(x, sizes)[0].sum()

    compiled, counter = counted_compile(first_group_sum)
    x = torch.randn(10, 4)
    for sizes in ([4, 6], [7, 3]):
        torch.testing.assert_close(compiled(x, sizes), x[:sizes[0]].sum())
    assert counter.frame_count == 2


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
def test_an_unbacked_token_count_compiles_the_routed_layer_once_for_every_count(fused):
    # torch's advice against recompiling for T = 0 and 1 is mark_unbacked: a Python check
    # that compared T * k with int32's limit guarded on the unbacked size and failed the trace.
    import groupgemm.torch as gt

    torch.manual_seed(0)
    router, experts = torch.randn(8, 4), gt.GroupedMLP(4, 8, 6, fused=fused)

    def layer(x):
        probs, indices = gt.softmax_topk(x @ router, 2)
        routed = experts.forward_routed(x, indices, probs)
        rows, _, row_map = gt.permute(x, indices, 4)
        return routed + gt.unpermute(rows, row_map, probs)

    compiled, counter = counted_compile(layer, backend="aot_eager")  # the trace is what failed: no Inductor needed
    for tokens in (5, 0, 1, 13):
        x = torch.randn(tokens, 8, requires_grad=True)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        out = compiled(x)
        grads = torch.autograd.grad(out.square().sum(), [x, *experts.parameters()])
        eager = layer(x)
        eager_grads = torch.autograd.grad(eager.square().sum(), [x, *experts.parameters()])
        assert torch.equal(out, eager) and all(torch.equal(g, e) for g, e in zip(grads, eager_grads))
    assert counter.frame_count == 1


def test_a_symbolic_expert_count_of_permute_is_refused_saying_so():
    # num_experts is a constant of the call; traced from a weight's dynamic shape it is a SymInt.
    class Permute(torch.nn.Module):
        def forward(self, x, indices, w):
            return gt.permute(x, indices, w.shape[0])

    args = (torch.randn(5, 4), torch.randint(0, 3, (5, 2)), torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"permute: num_experts must be a non-negative int, got \w+ \(a symbolic size"):
        torch.export.export(Permute(), args, dynamic_shapes=(None, None, {0: torch.export.Dim("experts")}))
