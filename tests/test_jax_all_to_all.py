"""Expert-parallel MoE under shard_map with all_to_all dispatch (fixed capacity), one
device with zero tokens, matches a single-device run.

Each device sends every other device a buffer of `CAPACITY` rows (enough that nothing
is dropped); unused rows are padding. After the exchange a device sorts what it
received by local expert, padding last, so the padding rows are exactly the rows past
sum(group_sizes): groupgemm leaves them 0 and gives them no gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from moe_dispatch import sort_by_expert

from groupgemm.jax import grouped_matmul

DEVICES, LOCAL, DIM, FFN, TOKENS = 4, 2, 8, 16, 6
EXPERTS, CAPACITY = DEVICES * LOCAL, TOKENS  # top-1: at most TOKENS rows to one device


def route(params, x, valid):
    probs = jax.nn.softmax(x @ params["router"])
    return probs.max(-1), jnp.where(valid, probs.argmax(-1), EXPERTS)  # padding: expert EXPERTS


def experts(w1, w2, x, sizes):
    return grouped_matmul(jax.nn.gelu(grouped_matmul(x, w1, sizes)), w2, sizes)


def ep_local(params, x, valid, target):
    gate, expert = route(params, x, valid)
    dest = expert // LOCAL  # device of each token's expert (DEVICES for padding)
    # Slot of each token inside its destination's buffer: rank among tokens to that device.
    onehot = jax.nn.one_hot(dest, DEVICES, dtype=jnp.int32)
    slot = (jnp.cumsum(onehot, 0) - 1)[jnp.arange(TOKENS), jnp.minimum(dest, DEVICES - 1)]
    flat = jnp.where(dest < DEVICES, dest * CAPACITY + slot, DEVICES * CAPACITY)  # last: dropped
    send_x = jnp.zeros((DEVICES * CAPACITY + 1, DIM)).at[flat].set(x)[:-1]
    send_e = jnp.full((DEVICES * CAPACITY + 1,), LOCAL).at[flat].set(expert % LOCAL)[:-1]
    recv_x = jax.lax.all_to_all(send_x.reshape(DEVICES, CAPACITY, DIM), "d", 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e.reshape(DEVICES, CAPACITY), "d", 0, 0, tiled=True)
    recv_x, recv_e = recv_x.reshape(-1, DIM), recv_e.reshape(-1)
    order, sizes = sort_by_expert(recv_e, LOCAL)  # by local expert, padding (LOCAL) last
    y = jnp.zeros_like(recv_x).at[order].set(experts(params["w1"], params["w2"], recv_x[order], sizes))
    back = jax.lax.all_to_all(y.reshape(DEVICES, CAPACITY, DIM), "d", 0, 0, tiled=True).reshape(-1, DIM)
    back = jnp.concatenate([back, jnp.zeros((1, DIM))])[flat]
    out = back * gate[:, None]
    sq = jnp.sum(jnp.where(valid[:, None], (out - target) ** 2, 0.0))
    return jax.lax.psum(sq, "d") / jnp.maximum(jax.lax.psum(valid.sum(), "d"), 1)


def single_loss(params, x, valid, target):
    gate, expert = route(params, x, valid)
    order, sizes = sort_by_expert(expert, EXPERTS)
    y = experts(params["w1"], params["w2"], x[order], sizes)
    out = jnp.zeros_like(x).at[order].set(y) * gate[:, None]
    return jnp.sum(jnp.where(valid[:, None], (out - target) ** 2, 0.0)) / jnp.maximum(valid.sum(), 1)


def test_all_to_all_expert_parallel_training_with_a_zero_token_device_matches_single_device():
    mesh = Mesh(np.array(jax.devices("cpu")[:DEVICES]), ("d",))
    specs = ({"router": P(), "w1": P("d"), "w2": P("d")}, P("d"), P("d"), P("d"))
    sharded = jax.jit(jax.value_and_grad(jax.shard_map(ep_local, mesh=mesh, in_specs=specs, out_specs=P())))
    single = jax.jit(jax.value_and_grad(single_loss))
    rng = np.random.default_rng(3)
    params = {"router": jnp.asarray(rng.standard_normal((DIM, EXPERTS)), jnp.float32),
              "w1": jnp.asarray(rng.standard_normal((EXPERTS, DIM, FFN)) / 3, jnp.float32),
              "w2": jnp.asarray(rng.standard_normal((EXPERTS, FFN, DIM)) / 4, jnp.float32)}
    p_a = p_b = params
    for step in range(3):
        x = jnp.asarray(rng.standard_normal((DEVICES * TOKENS, DIM)), jnp.float32)
        target = jnp.asarray(rng.standard_normal((DEVICES * TOKENS, DIM)), jnp.float32)
        valid = np.ones(DEVICES * TOKENS, bool)
        valid[2 * TOKENS:3 * TOKENS] = False  # device 2 has zero tokens
        loss_a, g_a = sharded(p_a, x, jnp.asarray(valid), target)
        loss_b, g_b = single(p_b, x, jnp.asarray(valid), target)
        np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=1e-5)
        for name in params:
            np.testing.assert_allclose(np.asarray(g_a[name]), np.asarray(g_b[name]), rtol=1e-4, atol=1e-6)
        p_a = jax.tree.map(lambda p, g: p - 0.1 * g, p_a, g_a)
        p_b = jax.tree.map(lambda p, g: p - 0.1 * g, p_b, g_b)
