"""The expert layer's JAX primitives under every transformation: forward and reverse mode to
second order against finite differences (float64), jacfwd of a whole MoE block, and vmap
against per-example calls (bitwise)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from jax_frontend import x64

import groupgemm.jax as gj

# Well-separated logits (a finite difference never changes a choice) with masked experts.
LOGITS = np.array([[0.3, -1.2, 2.1, -np.inf, 0.9], [1.7, -np.inf, -0.4, 0.2, -2.0], [-np.inf] * 5,
                   [0.0, 1.1, -np.inf, -np.inf, -np.inf]])
EXPERT_INDICES = np.array([[0, 2], [2, 2], [1, -1], [3, 0], [2, 1]], np.int32)  # one expert twice, a dropped slot
ROW_MAP = np.array([[1, 1], [9, 1], [-3, 4], [4, 0]], np.int32)  # rows named twice, entries outside [0, 5)


def rng_arrays(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s)) for s in shapes]


def expert_op_cases():
    """name: (function of float64 arrays, the arrays)."""
    tokens, permuted, probs = rng_arrays((5, 4), (5, 3), (4, 2))
    h = jnp.asarray(np.random.default_rng(1).uniform(0.2, 2.0, (6, 8)) * np.where(np.arange(8) % 2, 1, -1))
    x, w_in, w_out = rng_arrays((7, 3), (2, 8, 3), (2, 3, 4), seed=2)  # swiglu: w_out takes F = 4
    sizes = jnp.asarray([4, 0], jnp.int32)
    cases = {
        **{f"softmax_topk_{mode}": (lambda x, r=renormalize: gj.softmax_topk(x, 2, renormalize=r)[0],
                                    (jnp.asarray(LOGITS),))
           for mode, renormalize in (("renormalized", True), ("full_softmax", False))},
        "permute": (lambda t: gj.permute(t, EXPERT_INDICES, 3)[0], (tokens,)),
        "unpermute_with_probs": (lambda p, q: gj.unpermute(p, ROW_MAP, q), (permuted, probs)),
        "unpermute_without_probs": (lambda p: gj.unpermute(p, ROW_MAP), (permuted,)),
    }
    for activation in ("swiglu", "gelu", "relu", "silu"):
        f_in = 8 if activation == "swiglu" else 4
        cases[f"grouped_mlp_{activation}"] = (
            lambda x, a, b, act=activation: gj.grouped_mlp(x, a, b, sizes, activation=act, transpose_rhs=True),
            (x, w_in[:, :f_in], w_out))
    cases["activation_at_its_input"] = (  # the activation alone: h are the fc1 outputs, positive or negative
        lambda h: gj.grouped_mlp(h, jnp.eye(8)[None], jnp.eye(8, 4)[None], jnp.asarray([6], jnp.int32),
                                 transpose_rhs=True), (h,))
    return cases


@pytest.mark.parametrize("name", ["softmax_topk_renormalized", "softmax_topk_full_softmax", "permute",
                                  "unpermute_with_probs", "unpermute_without_probs", "grouped_mlp_swiglu",
                                  "grouped_mlp_gelu", "grouped_mlp_relu", "grouped_mlp_silu",
                                  "activation_at_its_input"])
def test_expert_ops_pass_check_grads_forward_and_reverse_to_second_order(name):
    with x64():
        fn, args = expert_op_cases()[name]
        check_grads(jax.jit(fn), args, order=2, modes=["fwd", "rev"])


def test_jacfwd_of_the_moe_block_matches_jacrev_with_exact_zeros_for_the_masked_expert():
    from moe_block import init_block, jax_block

    rng = np.random.default_rng(3)
    with x64():
        params = {k: jnp.asarray(v, jnp.float64) for k, v in init_block(rng, 6, 4, 3).items()}
        x = jnp.asarray(rng.standard_normal((5, 6)))
        allowed = np.array([True, False, True])  # expert 1 gets no token
        block = lambda p, x: jax_block(p, x, 2, allowed)[0]  # noqa: E731
        forward = jax.jacfwd(block, argnums=(0, 1))(params, x)
        reverse = jax.jacrev(block, argnums=(0, 1))(params, x)
    for f, r in zip(jax.tree_util.tree_leaves(forward), jax.tree_util.tree_leaves(reverse)):
        np.testing.assert_allclose(f, r, rtol=1e-10, atol=1e-12)
    dparams = forward[0]  # the masked expert's weights and router column: exact zeros
    assert not dparams["w_in"][:, :, 1].any() and not dparams["w_out"][:, :, 1].any()
    assert not dparams["router"][..., 1].any() and dparams["router"].any()


def test_linear_transpose_of_permute_and_unpermute_is_the_adjoint():
    # <f(x), y> == <x, f^T(y)> for the linear maps tokens -> permuted and permuted -> out.
    with x64():
        tokens, permuted, probs = rng_arrays((5, 4), (5, 3), (4, 2), seed=5)
        for fn, x in ((lambda t: gj.permute(t, EXPERT_INDICES, 3)[0], tokens),
                      (lambda p: gj.unpermute(p, ROW_MAP, probs), permuted)):
            y = jnp.asarray(np.random.default_rng(6).standard_normal(fn(x).shape))
            (transposed,) = jax.linear_transpose(fn, x)(y)
            np.testing.assert_allclose(jnp.vdot(fn(x), y), jnp.vdot(x, transposed), rtol=1e-12)


def per_example(fn, *batched):
    return [fn(*xs) for xs in zip(*batched)]


def test_vmap_of_each_expert_op_matches_per_example_calls_bitwise():
    b = 3
    logits = jnp.asarray(np.random.default_rng(4).standard_normal((b, 4, 5)), jnp.float32)
    tokens, permuted, probs = (jnp.asarray(a, jnp.float32) for a in rng_arrays((b, 5, 4), (b, 5, 3), (b, 4, 2)))
    indices = jnp.asarray(np.stack([EXPERT_INDICES, EXPERT_INDICES[::-1], np.full_like(EXPERT_INDICES, -1)]))
    row_maps = jnp.asarray(np.stack([ROW_MAP, ROW_MAP[::-1], ROW_MAP % 5]))
    calls = {
        "softmax_topk": (lambda x: gj.softmax_topk(x, 2), (logits,)),
        "permute": (lambda t, i: gj.permute(t, i, 3), (tokens, indices)),
        "unpermute": (lambda p, r, q: gj.unpermute(p, r, q), (permuted, row_maps, probs)),
        "grouped_mlp": (lambda x: gj.grouped_mlp(x, jnp.ones((2, 3, 8)) / 4, jnp.ones((2, 4, 3)) / 4,
                                                 jnp.asarray([2, 3], jnp.int32)), (permuted,)),
        "unpermute_grad": (jax.grad(lambda p, r, q: gj.unpermute(p, r, q).sum()), (permuted, row_maps, probs)),
        "softmax_topk_jvp": (lambda x: jax.jvp(lambda y: gj.softmax_topk(y, 2)[0], (x,), (jnp.ones_like(x),))[1],
                             (logits,)),
    }
    for name, (fn, args) in calls.items():
        batched = jax.tree_util.tree_leaves(jax.vmap(fn)(*args))
        singles = per_example(fn, *args)
        for i, leaf in enumerate(batched):
            want = np.stack([np.asarray(jax.tree_util.tree_leaves(s)[i]) for s in singles])
            assert np.array_equal(np.asarray(leaf), want), name


def test_gradients_of_an_operand_shared_across_a_vmapped_batch_sum_over_it():
    # vmap binds one call for the whole batch; an operand without the batch axis gets the
    # sum of its per-example gradients (here to second order for the router's weights).
    with x64():
        permuted, tokens, router = rng_arrays((5, 3), (5, 4), (3, 5), seed=7)
        probs, weights, x = rng_arrays((3, 4, 2), (3, 10, 4), (3, 4, 3), seed=8)
        row_maps = jnp.asarray(np.stack([ROW_MAP, ROW_MAP[::-1], ROW_MAP % 5]))
        indices = jnp.asarray(np.stack([EXPERT_INDICES, EXPERT_INDICES[::-1], np.full_like(EXPERT_INDICES, -1)]))
        cases = {  # name: (loss of one example, the shared operand, the batched ones)
            "unpermute's rows": (lambda p, r, q: gj.unpermute(p, r, q).sum(), permuted, (row_maps, probs)),
            "unpermute's probs": (lambda q, p, r: gj.unpermute(p, r, q).sum(), probs[0],
                                  (jnp.stack([permuted, 2 * permuted, -permuted]), row_maps)),
            "permute's tokens": (lambda t, i, w: jnp.sum(gj.permute(t, i, 4)[0] * w), tokens, (indices, weights)),
            "the router's weights": (lambda w, x: jnp.sum(gj.softmax_topk(x @ w, 2)[0] ** 2), router, (x,)),
        }
        for name, (loss, shared, batched) in cases.items():
            grad = jax.grad(lambda s: jax.vmap(lambda *b: loss(s, *b))(*batched).sum())
            want = sum(jax.grad(loss)(shared, *b) for b in zip(*batched))
            np.testing.assert_allclose(grad(shared), want, rtol=1e-12, atol=1e-15, err_msg=name)
        batched_hessian = jax.hessian(lambda w: jax.vmap(lambda x: cases["the router's weights"][0](w, x))(x).sum())
        want = sum(jax.hessian(cases["the router's weights"][0])(router, xs) for xs in x)
        np.testing.assert_allclose(batched_hessian(router), want, rtol=1e-10, atol=1e-13)
