"""An expert-parallel MoE layer of permute, grouped_mlp and unpermute under shard_map on 4
CPU devices, with devices that have no tokens, a device whose experts get none and a step
where no device has any, trains like one device.

Dispatch is all-gather style: every device permutes all tokens over all experts, runs only
its own window of experts (``group_offset = axis_index * LOCAL``; rows of other experts
come out as exact zeros) and unpermutes with the router's weights; a reduce-scatter then
sums the devices' partial outputs into each device's tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import groupgemm.jax as gj

DEVICES, LOCAL, TOP_K, DIM, FFN, TOKENS, STEPS, LR = 4, 2, 2, 8, 16, 6, 4, 0.1
EXPERTS = DEVICES * LOCAL
DROP_BELOW = 0.2  # a slot whose renormalised weight is below this is dropped (routed nowhere)


def route(router, x, valid, allowed):
    """(expert_indices [T, k], probs [T, k]): softmax over the allowed experts, top-k,
    weights renormalised; padding tokens and small-weight slots are dropped (index -1)."""
    logits = jnp.where(allowed, x @ router, -jnp.inf)
    probs, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), TOP_K)
    probs = probs / probs.sum(-1, keepdims=True)
    return jnp.where(valid[:, None] & (probs >= DROP_BELOW), experts, -1), probs


def moe_layer(params, x, valid, allowed, group_offset):
    expert_indices, probs = route(params["router"], x, valid, allowed)
    permuted, group_sizes, row_map = gj.permute(x, expert_indices, EXPERTS)
    y = gj.grouped_mlp(permuted, params["w_in"], params["w_out"], group_sizes, activation="swiglu",
                       group_offset=group_offset)
    return gj.unpermute(y, row_map, probs), group_sizes


def masked_mean_square(out, target, valid):
    return jnp.sum(jnp.where(valid[:, None], (out - target) ** 2, 0.0))


def loss_single(params, x, valid, target, allowed):
    out, _ = moe_layer(params, x, valid, allowed, None)
    return masked_mean_square(out, target, valid) / jnp.maximum(valid.sum(), 1)


def loss_sharded(mesh):
    def local(params, x, valid, target, allowed):
        all_x = jax.lax.all_gather(x, "d", tiled=True)
        all_valid = jax.lax.all_gather(valid, "d", tiled=True)
        partial, group_sizes = moe_layer(params, all_x, all_valid, allowed, jax.lax.axis_index("d") * LOCAL)
        out = jax.lax.psum_scatter(partial, "d", tiled=True)  # my tokens, every device's experts
        total = jnp.maximum(jax.lax.psum(valid.sum(), "d"), 1)
        return jax.lax.psum(masked_mean_square(out, target, valid), "d") / total, group_sizes[None]

    specs = ({"router": P(), "w_in": P("d"), "w_out": P("d")}, P("d"), P("d"), P("d"), P())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), P("d")))


def init_params(rng):
    return {"router": jnp.asarray(rng.standard_normal((DIM, EXPERTS)), jnp.float32),
            "w_in": jnp.asarray(rng.standard_normal((EXPERTS, DIM, 2 * FFN)) / np.sqrt(DIM), jnp.float32),
            "w_out": jnp.asarray(rng.standard_normal((EXPERTS, FFN, DIM)) / np.sqrt(FFN), jnp.float32)}


def step_inputs(step, rng):
    """Tokens, targets, which tokens are real and which experts may be chosen, per step."""
    x = jnp.asarray(rng.standard_normal((DEVICES * TOKENS, DIM)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((DEVICES * TOKENS, DIM)), jnp.float32)
    valid = np.ones(DEVICES * TOKENS, bool)
    allowed = np.ones(EXPERTS, bool)
    if step in (0, 3):
        valid[TOKENS:2 * TOKENS] = False  # device 1 has no tokens: all its slots are dropped
    if step == 1:
        valid[3 * TOKENS:] = False  # device 3 has none...
        allowed[2 * LOCAL:3 * LOCAL] = False  # ...and device 2's experts get none
    if step == 2:
        valid[:] = False  # no device has any token
    return x, jnp.asarray(valid), target, jnp.asarray(allowed)


def test_expert_parallel_moe_layer_with_zero_token_devices_matches_single_device():
    mesh = Mesh(np.array(jax.devices("cpu")[:DEVICES]), ("d",))
    rng = np.random.default_rng(0)
    init = init_params(rng)
    sharded_step = jax.jit(jax.value_and_grad(loss_sharded(mesh), has_aux=True))
    single_step = jax.jit(jax.value_and_grad(loss_single))
    p_sharded, p_single = init, init
    dropped = 0
    for step in range(STEPS):
        x, valid, target, allowed = step_inputs(step, rng)
        (loss_a, group_sizes), grads_a = sharded_step(p_sharded, x, valid, target, allowed)
        loss_b, grads_b = single_step(p_single, x, valid, target, allowed)
        sizes = np.asarray(group_sizes)[0]  # every device permutes the same gathered tokens
        if step == 1:
            assert sizes[2 * LOCAL:3 * LOCAL].sum() == 0  # device 2 ran its experts on no rows
        if step == 2:
            assert sizes.sum() == 0 and float(loss_a) == 0.0
            assert all(not np.asarray(g).any() for g in jax.tree.leaves(grads_a))  # exact-zero gradients
        dropped += int(valid.sum()) * TOP_K - int(sizes.sum())
        np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-5, atol=1e-7)
        for name in init:
            np.testing.assert_allclose(np.asarray(grads_a[name]), np.asarray(grads_b[name]), rtol=1e-4, atol=1e-6)
        p_sharded = jax.tree.map(lambda p, g: p - LR * g, p_sharded, grads_a)
        p_single = jax.tree.map(lambda p, g: p - LR * g, p_single, grads_b)
    assert dropped > 0  # the router dropped some slots of real tokens too
    for name in init:
        assert not np.allclose(np.asarray(p_single[name]), np.asarray(init[name]))  # training moved it
        np.testing.assert_allclose(np.asarray(p_sharded[name]), np.asarray(p_single[name]), rtol=1e-4, atol=1e-6)
