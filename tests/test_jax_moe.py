"""A jitted MoE layer trains with groupgemm exactly as with jax.lax.ragged_dot."""

import jax
import jax.numpy as jnp
import numpy as np
from moe_dispatch import sort_by_expert

from groupgemm.jax import grouped_matmul

TOKENS, DIM, FFN, EXPERTS, TOP_K = 64, 16, 32, 6, 2
NEVER_ROUTED = (1, 4)  # experts the router cannot pick: they receive zero tokens


def moe_layer(params, x, matmul):
    """Top-k routing, dispatch by sort, two grouped matmuls, weighted combine."""
    logits = x @ params["router"] + params["router_bias"]
    top_p, top_e = jax.lax.top_k(jax.nn.softmax(logits), TOP_K)
    flat_e = top_e.reshape(-1)
    order, sizes = sort_by_expert(flat_e, EXPERTS)
    token = order // TOP_K
    h = jax.nn.gelu(matmul(x[token], params["w1"], sizes))
    y = matmul(h, params["w2"], sizes) * top_p.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(y), sizes


def loss_fn(params, x, target, matmul):
    out, sizes = moe_layer(params, x, matmul)
    return jnp.mean((out - target) ** 2), sizes


def init(seed=0):
    rng = np.random.default_rng(seed)
    router_bias = np.zeros(EXPERTS, np.float32)
    router_bias[list(NEVER_ROUTED)] = -1e4
    return {
        "router": jnp.asarray(rng.standard_normal((DIM, EXPERTS)) * 0.5, jnp.float32),
        "router_bias": jnp.asarray(router_bias),
        "w1": jnp.asarray(rng.standard_normal((EXPERTS, DIM, FFN)) / np.sqrt(DIM), jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((EXPERTS, FFN, DIM)) / np.sqrt(FFN), jnp.float32),
    }


def train(matmul, steps=4, lr=0.1):
    rng = np.random.default_rng(1)

    @jax.jit
    def step(params, x, target):
        (loss, sizes), grads = jax.value_and_grad(lambda p: loss_fn(p, x, target, matmul), has_aux=True)(params)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, grads, sizes

    params, history = init(), []
    for _ in range(steps):
        x = jnp.asarray(rng.standard_normal((TOKENS, DIM)), jnp.float32)
        target = jnp.asarray(rng.standard_normal((TOKENS, DIM)), jnp.float32)
        params, loss, grads, sizes = step(params, x, target)
        history.append((float(loss), grads, np.asarray(sizes)))
    return params, history


def test_moe_training_matches_ragged_dot_with_zero_token_experts():
    ours_params, ours = train(lambda x, w, s: grouped_matmul(x, w, s))
    lax_params, theirs = train(lambda x, w, s: jax.lax.ragged_dot(x, w, s))
    for (loss_a, grads_a, sizes), (loss_b, grads_b, _) in zip(ours, theirs):
        assert (sizes[list(NEVER_ROUTED)] == 0).all()
        np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
        for name in ("router", "w1", "w2"):
            np.testing.assert_allclose(np.asarray(grads_a[name]), np.asarray(grads_b[name]), rtol=1e-4, atol=1e-6)
        for e in NEVER_ROUTED:  # full-shape, exact-zero gradients for experts without tokens
            assert (np.asarray(grads_a["w1"][e]) == 0).all() and (np.asarray(grads_a["w2"][e]) == 0).all()
    for name in ("w1", "w2"):
        np.testing.assert_allclose(np.asarray(ours_params[name]), np.asarray(lax_params[name]), rtol=1e-4, atol=1e-6)
