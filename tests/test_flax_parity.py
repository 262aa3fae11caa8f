"""groupgemm.flax's layers give groupgemm.torch's bits: each PyTorch module's parameters
copied into its Flax NNX twin, the outputs and every gradient (the input's and each
parameter's) are bitwise identical, with experts that get no tokens, whose gradients are
exact zeros in both, and rows owned by no expert."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from bits import assert_same_bits
from clients import require
from moe_block import init_block, torch_block_class

nnx = require("flax.nnx")
import groupgemm.flax as gf  # noqa: E402
import groupgemm.torch as gt  # noqa: E402

EXPERTS, HIDDEN, FFN, ROWS = 4, 8, 6, 10
SIZES = [3, 0, 5, 0]  # experts 1 and 3 get no rows; rows 8 and 9 belong to none
IDLE = [1, 3]


def to_jax(t):
    """A tensor's values as a JAX array of its dtype (through float32: exact for 16-bit floats)."""
    return jnp.asarray(t.detach().float().numpy()).astype(str(t.dtype).removeprefix("torch."))


def at(tree, path):
    for name in path.split("."):
        tree = getattr(tree, name) if hasattr(tree, name) else tree[name]
    return tree


def twin(make):
    """The NNX layer ``make()`` builds, its parameters only shapes (nnx.eval_shape): any the
    test does not copy in from PyTorch fails the call."""
    return nnx.eval_shape(make)


def run_both(torch_module, nnx_module, x, extra_torch=(), extra_jax=()):
    """Copies torch_module's parameters into nnx_module, runs both on x (and the extra
    arguments) with the same incoming gradient; returns {name: (jax, torch)} for the
    output, the input's gradient and each parameter's gradient."""
    for name, p in torch_module.named_parameters():
        assert at(nnx_module, name).shape == tuple(p.shape), name
        at(nnx_module, name).set_value(to_jax(p))
    xt = x.clone().requires_grad_(True)
    out_t = torch_module(xt, *extra_torch)
    out_t = out_t[0] if isinstance(out_t, tuple) else out_t
    dy = torch.from_numpy(np.random.default_rng(5).standard_normal(out_t.shape)).to(out_t.dtype)
    out_t.backward(dy)

    def loss(module, x):
        out = module(x, *extra_jax)
        return jnp.sum(out.astype(jnp.float32) * to_jax(dy).astype(jnp.float32)), out

    (_, out_j), (grads, dx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(nnx_module, to_jax(x))
    results = {"out": (out_j, out_t), "dx": (dx, xt.grad)}
    for name, p in torch_module.named_parameters():
        results[name] = (at(grads, name)[...], p.grad)
    return results


def check(results, what, idle_parameters=()):
    for name, (jax_value, torch_value) in results.items():
        assert_same_bits(np.asarray(jax_value), torch_value, f"{what} {name}")
    for name in idle_parameters:  # the experts without tokens: exact zeros, full shape
        grad = np.asarray(results[name][0])
        assert grad.shape[0] == EXPERTS and (grad[IDLE] == 0).all() and grad[0].any(), name
    assert (np.asarray(results["out"][0])[sum(SIZES):] == 0).all()


def rows(dtype=torch.float32):
    return torch.from_numpy(np.random.default_rng(0).standard_normal((ROWS, HIDDEN))).to(dtype)


@pytest.mark.parametrize("bias, dtype", [(True, torch.float32), (False, torch.bfloat16)])
def test_grouped_linear_gives_pytorchs_bits(bias, dtype):
    torch.manual_seed(0)
    layer = gt.GroupedLinear(EXPERTS, HIDDEN, FFN, bias=bias, dtype=dtype)
    nnx_layer = twin(lambda: gf.GroupedLinear(EXPERTS, HIDDEN, FFN, bias=bias, dtype=to_jax(layer.weight).dtype,
                                              rngs=nnx.Rngs(0)))
    assert (nnx_layer.bias is None) == (layer.bias is None)
    results = run_both(layer, nnx_layer, rows(dtype), (torch.tensor(SIZES),), (jnp.asarray(SIZES, jnp.int32),))
    check(results, f"GroupedLinear bias={bias} {dtype}", ["weight", "bias"] if bias else ["weight"])


@pytest.mark.parametrize("activation, bias, fp8, dtype", [("swiglu", False, None, torch.float32),
                                                          ("gelu", True, None, torch.float32),
                                                          ("swiglu", False, "rowwise", torch.bfloat16)])
def test_grouped_mlp_gives_pytorchs_bits(activation, bias, fp8, dtype):
    torch.manual_seed(1)
    mlp = gt.GroupedMLP(EXPERTS, HIDDEN, FFN, activation=activation, bias=bias, fp8=fp8, dtype=dtype)
    nnx_mlp = twin(lambda: gf.GroupedMLP(EXPERTS, HIDDEN, FFN, activation=activation, bias=bias, fp8=fp8,
                                         dtype=to_jax(mlp.fc1.weight).dtype, rngs=nnx.Rngs(0)))
    results = run_both(mlp, nnx_mlp, rows(dtype), (torch.tensor(SIZES),), (jnp.asarray(SIZES, jnp.int32),))
    check(results, f"GroupedMLP {activation} bias={bias} fp8={fp8}", ["fc1.weight", "fc2.weight"])


# Routed tokens for forward_routed: global ids, the layers holding experts [2, 6) (group_offset
# 2); experts 1 and 3 (ids 3 and 5) get no slot, and tokens 8 and 9 no slot in the window
# (ids -1, 1 and 6), so their outputs are 0, as check() asks of rows 8 and 9.
ROUTED_IDS = [[2, 4], [4, 2], [2, 6], [4, 4], [2, -1], [6, 4], [2, 1], [4, 2], [-1, 1], [6, -1]]


class TorchRouted(torch.nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x, indices, probs):
        return self.mlp.forward_routed(x, indices, probs, group_offset=2)


class NnxRouted(nnx.Module):
    def __init__(self, mlp):
        self.mlp = mlp

    def __call__(self, x, indices, probs):
        return self.mlp.forward_routed(x, indices, probs, group_offset=2)


@pytest.mark.parametrize("fused, fp8, dtype", [(None, None, torch.float32), (False, None, torch.float32),
                                               (None, "rowwise", torch.bfloat16)])
def test_grouped_mlp_forward_routed_gives_pytorchs_bits(fused, fp8, dtype):
    # fused=None: the fused op on the CPU in both frameworks, the composition under fp8.
    torch.manual_seed(3)
    mlp = gt.GroupedMLP(EXPERTS, HIDDEN, FFN, bias=True, fp8=fp8, dtype=dtype, fused=fused)
    nnx_mlp = twin(lambda: NnxRouted(gf.GroupedMLP(EXPERTS, HIDDEN, FFN, bias=True, fp8=fp8, fused=fused,
                                                   dtype=to_jax(mlp.fc1.weight).dtype, rngs=nnx.Rngs(0))))
    probs = torch.from_numpy(np.random.default_rng(4).random((ROWS, 2), np.float32))
    indices = torch.tensor(ROUTED_IDS, dtype=torch.int32)
    results = run_both(TorchRouted(mlp), nnx_mlp, rows(dtype), (indices, probs), (to_jax(indices), to_jax(probs)))
    check(results, f"GroupedMLP.forward_routed fused={fused} fp8={fp8}",
          ["mlp.fc1.weight", "mlp.fc2.weight", "mlp.fc1.bias", "mlp.fc2.bias"])


class RoutedBlock(torch.nn.Module):
    """examples/moe_block.py's PyTorch block with its experts applied by
    GroupedMLP.forward_routed (the fused op where ``experts.fused`` says so)."""

    def __init__(self, block):
        super().__init__()
        self.top_k, self.router, self.experts = block.top_k, block.router, block.experts

    def forward(self, x, allowed):
        logits = gt.grouped_mm(x, self.router[None], torch.full((1,), x.shape[0], dtype=torch.int32))
        probs, experts = gt.softmax_topk(logits.masked_fill(~allowed, float("-inf")), self.top_k)
        return self.experts.forward_routed(x, experts, probs)


@pytest.mark.parametrize("fused", [None, True, False])
def test_moe_gives_the_bits_of_pytorchs_router_and_experts(fused):
    # The single-process PyTorch layer MoE mirrors: examples/moe_block.py's block (softmax_topk
    # router, permute, GroupedMLP, unpermute) for the composition, its experts through
    # forward_routed for the fused op and the default (fused on the CPU in both frameworks);
    # experts 1 and 3 barred.
    block = torch_block_class()(init_block(np.random.default_rng(2), HIDDEN, FFN, EXPERTS), top_k=2)
    block.experts.fused = fused
    allowed = np.ones(EXPERTS, bool)
    allowed[IDLE] = False
    moe = twin(lambda: gf.MoE(EXPERTS, HIDDEN, FFN, 2, fused=fused, rngs=nnx.Rngs(0)))
    results = run_both(block if fused is False else RoutedBlock(block), moe, rows(), (torch.from_numpy(allowed),),
                       (jnp.asarray(allowed),))
    for name, (jax_value, torch_value) in results.items():
        assert_same_bits(np.asarray(jax_value), torch_value, f"MoE fused={fused} {name}")
    for name in ("experts.fc1.weight", "experts.fc2.weight"):
        grad = np.asarray(results[name][0])
        assert (grad[IDLE] == 0).all() and grad[0].any() and grad[2].any(), name
