"""The routed expert layers under FSDP2 (fully_shard) and activation checkpointing's
wrapper, and the module hooks they rely on. FSDP2 gathers a module's parameters in a hook
around a call of the module, and checkpoint_wrapper wraps that call: the routed form must be
such a call, fused or composed."""

import copy

import pytest
import torch
import torch.distributed as dist

import groupgemm.torch as gt

T, H, F, E, K = 7, 8, 6, 4, 2


def routed_inputs():
    torch.manual_seed(1)
    tokens = torch.randn(T, H, requires_grad=True)
    ids = torch.tensor([[0, 2], [2, 0], [1, 2], [0, -1], [2, 1], [1, 0], [2, 2]], dtype=torch.int32)  # expert 3 idle
    probs = torch.rand(T, K, requires_grad=True)
    return tokens, ids, probs


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fused", [True, False])
def test_the_routed_form_is_a_call_of_the_module_so_its_hooks_run_once(fused):
    mlp = gt.GroupedMLP(E, H, F, fused=fused)
    seen = []
    mlp.register_forward_pre_hook(lambda module, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)
    tokens, ids, probs = routed_inputs()
    out = mlp.forward_routed(tokens, ids, probs)
    assert seen == [["expert_indices", "group_offset", "probs"]]
    assert torch.equal(mlp(tokens, expert_indices=ids, probs=probs), out)


@pytest.mark.parametrize("fused", [True, False])
def test_a_checkpoint_wrapper_recomputes_the_routed_form_called_as_the_module(fused):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    mlp = gt.GroupedMLP(E, H, F, fused=fused)
    tokens, ids, probs = routed_inputs()
    mlp.forward_routed(tokens, ids, probs).square().sum().backward()
    expected = [t.grad.clone() for t in (tokens, probs, *mlp.parameters())]
    calls = []
    mlp.register_forward_pre_hook(lambda module, args: calls.append(1))
    tokens, ids, probs = routed_inputs()
    mlp.zero_grad()
    out = checkpoint_wrapper(mlp)(tokens, expert_indices=ids, probs=probs)
    assert len(calls) == 1
    out.square().sum().backward()
    assert len(calls) == 2  # run again in the backward
    for got, want in zip((tokens.grad, probs.grad, *(p.grad for p in mlp.parameters())), expected):
        assert torch.equal(got, want)


def test_the_two_forms_are_refused_together_or_neither_naming_them():
    mlp = gt.GroupedMLP(E, H, F)
    tokens, ids, probs = routed_inputs()
    sizes = torch.tensor([2, 2, 2, 1])
    with pytest.raises(TypeError, match="GroupedMLP: give group_sizes .* or expert_indices .*; got both"):
        mlp(tokens, sizes, expert_indices=ids)
    with pytest.raises(TypeError, match="GroupedMLP: give group_sizes .* or expert_indices .*; got neither"):
        mlp(tokens)
    with pytest.raises(TypeError, match="GroupedMLP: probs and group_offset go with expert_indices"):
        mlp(tokens, sizes, probs=probs)


def _fsdp_run(layer, sharded_part, call):
    """Output and gradients of one step of `layer`, unsharded and with `sharded_part(layer)`
    given its own fully_shard and the whole layer, where it is another module, one more
    (torchtitan's layout)."""
    from torch.distributed.fsdp import fully_shard

    results = []
    for shard in (False, True):
        model = copy.deepcopy(layer)
        if shard:
            part = fully_shard(sharded_part(model))
            if part is not model:
                fully_shard(model)
        tokens, ids, probs = routed_inputs()
        out = call(model, tokens, ids, probs)
        out.square().sum().backward()
        grads = {name: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for name, p in model.named_parameters()}
        results.append((out.detach(), tokens.grad, grads))
    return results


@pytest.mark.parametrize("fused", [True, False])
def test_grouped_mlp_with_its_own_fully_shard_gives_the_unsharded_bits(one_rank, fused):
    torch.manual_seed(0)
    mlp = gt.GroupedMLP(E, H, F, bias=True, fused=fused)
    (out, dtokens, grads), (fsdp_out, fsdp_dtokens, fsdp_grads) = _fsdp_run(
        mlp, lambda model: model, lambda model, tokens, ids, probs: model.forward_routed(tokens, ids, probs))
    assert torch.equal(fsdp_out, out) and torch.equal(fsdp_dtokens, dtokens)
    for name, grad in grads.items():
        assert torch.equal(fsdp_grads[name], grad), name
    assert torch.all(grads["fc1.weight"][3] == 0) and torch.all(grads["fc2.weight"][3] == 0)  # the idle expert


@pytest.mark.parametrize("fused", [True, False])
def test_expert_parallel_layer_with_sharded_experts_gives_the_unsharded_bits(one_rank, fused):
    torch.manual_seed(0)
    moe = gt.ExpertParallelMoE(E, H, F, K, fused=fused)
    (out, dtokens, grads), (fsdp_out, fsdp_dtokens, fsdp_grads) = _fsdp_run(
        moe, lambda model: model.experts, lambda model, tokens, ids, probs: model(tokens)[0])
    assert torch.equal(fsdp_out, out) and torch.equal(fsdp_dtokens, dtokens)
    for name, grad in grads.items():
        assert torch.equal(fsdp_grads[name], grad), name
