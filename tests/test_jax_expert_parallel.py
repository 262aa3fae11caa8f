"""Expert-parallel MoE training under shard_map on 4 CPU devices, one device with zero
tokens, matches a single-device run.

Dispatch is all-gather style (Megatron's "allgather" token dispatcher): every device
sees all tokens sorted by global expert, runs only its own experts by passing
``group_offset = axis_index * local_experts``, and rows of other experts come back as
exact zeros, so a reduce-scatter combines the partial results exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from moe_dispatch import sort_by_expert

from groupgemm.jax import grouped_matmul

DEVICES, LOCAL_EXPERTS, DIM, FFN, TOKENS = 4, 2, 8, 16, 6
EXPERTS = DEVICES * LOCAL_EXPERTS


def moe(params, x, valid, group_offset, num_local):
    """x [T, D] all tokens; invalid (padding) tokens are routed nowhere."""
    probs = jax.nn.softmax(x @ params["router"])
    gate, expert = probs.max(-1), probs.argmax(-1)
    expert = jnp.where(valid, expert, EXPERTS)  # padding sorts last and joins no group
    order, sizes = sort_by_expert(expert, EXPERTS)
    h = jax.nn.gelu(grouped_matmul(x[order], params["w1"], sizes, group_offset=group_offset))
    y = grouped_matmul(h, params["w2"], sizes, group_offset=group_offset)
    return jnp.zeros_like(x).at[order].add(y * gate[order][:, None])


def loss_single(params, x, valid, target):
    out = moe(params, x, valid, None, EXPERTS)
    return jnp.sum(jnp.where(valid[:, None], (out - target) ** 2, 0.0)) / jnp.maximum(valid.sum(), 1)


def loss_sharded(mesh):
    def local(params, x, valid, target):
        all_x = jax.lax.all_gather(x, "d", tiled=True)
        all_valid = jax.lax.all_gather(valid, "d", tiled=True)
        offset = jax.lax.axis_index("d") * LOCAL_EXPERTS
        partial = moe(params, all_x, all_valid, offset, LOCAL_EXPERTS)
        out = jax.lax.psum_scatter(partial, "d", tiled=True)  # my tokens, all experts
        sq = jnp.sum(jnp.where(valid[:, None], (out - target) ** 2, 0.0))
        return jax.lax.psum(sq, "d") / jnp.maximum(jax.lax.psum(valid.sum(), "d"), 1)

    specs = ({"router": P(), "w1": P("d"), "w2": P("d")}, P("d"), P("d"), P("d"))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P())


def test_expert_parallel_training_with_a_zero_token_device_matches_single_device():
    mesh = Mesh(np.array(jax.devices("cpu")[:DEVICES]), ("d",))
    rng = np.random.default_rng(0)
    params = {"router": jnp.asarray(rng.standard_normal((DIM, EXPERTS)), jnp.float32),
              "w1": jnp.asarray(rng.standard_normal((EXPERTS, DIM, FFN)) / 3, jnp.float32),
              "w2": jnp.asarray(rng.standard_normal((EXPERTS, FFN, DIM)) / 4, jnp.float32)}
    sharded_step = jax.jit(jax.value_and_grad(loss_sharded(mesh)))
    single_step = jax.jit(jax.value_and_grad(loss_single))
    p_sharded, p_single = params, params
    for step in range(4):
        x = jnp.asarray(rng.standard_normal((DEVICES * TOKENS, DIM)), jnp.float32)
        target = jnp.asarray(rng.standard_normal((DEVICES * TOKENS, DIM)), jnp.float32)
        valid = np.ones(DEVICES * TOKENS, bool)
        valid[TOKENS:2 * TOKENS] = False  # device 1 has zero tokens this step...
        if step == 2:
            valid[:] = False  # ...and on this step no device has any
        valid = jnp.asarray(valid)
        loss_a, grads_a = sharded_step(p_sharded, x, valid, target)
        loss_b, grads_b = single_step(p_single, x, valid, target)
        np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-5, atol=1e-7)
        for name in params:
            np.testing.assert_allclose(np.asarray(grads_a[name]), np.asarray(grads_b[name]), rtol=1e-4, atol=1e-6)
        p_sharded = jax.tree.map(lambda p, g: p - 0.1 * g, p_sharded, grads_a)
        p_single = jax.tree.map(lambda p, g: p - 0.1 * g, p_single, grads_b)
    for name in params:
        np.testing.assert_allclose(np.asarray(p_sharded[name]), np.asarray(p_single[name]), rtol=1e-4, atol=1e-6)
