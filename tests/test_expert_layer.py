"""The expert layer (the router, permute, unpermute, the grouped MLP) in both frontends against the
float64 NumPy reference, forward and every gradient, in every dtype; JAX/PyTorch parity."""

import dataclasses

import expert_reference as eref
import jax_frontend
import numpy as np
import pytest
import reference as ref
import torch_frontend
from bad_inputs import base_arguments
from bits import assert_same_bits
from cases import DTYPES, TOLERANCE, round_to
from frontends import frontend  # noqa: F401 - the fixture


@dataclasses.dataclass(frozen=True)
class Routing:
    name: str
    indices: tuple  # [T][k] expert choices; outside [0, num_experts) is a dropped slot
    num_experts: int

    @property
    def shape(self):
        return len(self.indices), len(self.indices[0]) if self.indices else 2


ROUTINGS = [
    Routing("top1", ((2,), (0,), (2,), (1,), (0,), (2,)), 3),
    Routing("top2", ((1, 0), (2, 1), (0, 2), (1, 2), (0, 1)), 3),
    Routing("top3", ((3, 0, 1), (2, 3, 1), (0, 1, 2), (1, 2, 0)), 4),
    Routing("top4", ((0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2)), 4),
    Routing("no_tokens", (), 3),
    Routing("one_expert", ((1, 1), (1, 1), (1, 1)), 3),
    Routing("every_expert_empty", ((-1, 3), (7, -5), (3, 3)), 3),
    Routing("dropped_slots", ((0, -1), (3, 1), (2, 2**31 - 1), (-(2**31), 0)), 3),
    Routing("same_expert_twice", ((2, 2), (0, 2), (2, 0)), 3),
    Routing("no_experts", ((0, 1), (2, 0)), 0),
]
IDS = [r.name for r in ROUTINGS]


ROUTER_LOGITS = {  # name: [T, E] logits (T = 0: no tokens)
    "random": np.random.default_rng(5).standard_normal((6, 5)) * 2,
    "ties": np.array([[1.0, 1.0, 1.0, 0.0, 1.0], [0.0, 2.0, 2.0, 2.0, -1.0], [3.0, 3.0, 3.0, 3.0, 3.0]]),
    "masked": np.array([[0.5, -np.inf, 1.5, -np.inf, 0.0], [-np.inf] * 5, [-np.inf, -np.inf, 2.0, -np.inf, -np.inf],
                        [1.0, 0.0, -np.inf, 2.0, -1.0]]),
    "no_tokens": np.zeros((0, 5)),
}


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "full_softmax"])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ROUTER_LOGITS)
def test_softmax_topk_matches_reference_with_its_gradient(frontend, name, dtype, k, renormalize):
    logits = round_to(ROUTER_LOGITS[name], dtype)
    dprobs = np.random.default_rng(6).standard_normal((len(logits), k))
    check_softmax_topk(frontend, logits, k, renormalize, dprobs, dtype,
                       frontend.softmax_topk_and_grad(logits, k, renormalize, dprobs, dtype))


def check_softmax_topk(frontend, logits, k, renormalize, dprobs, dtype, result):
    """(probs, expert_indices, dlogits) against the float64 reference: the choices exactly,
    exact zeros where a slot is dropped and (renormalized) for experts not chosen."""
    probs, indices, dlogits = result
    want_probs, want_indices = eref.softmax_topk(logits, k, renormalize)
    probs_dtype = "float64" if dtype == "float64" else "float32"
    assert frontend.dtype_of(indices) == "int32" and frontend.dtype_of(probs) == probs_dtype
    assert np.array_equal(frontend.to_float64(indices), want_indices)
    got_probs = frontend.to_float64(probs)
    ref.assert_close(got_probs, want_probs, probs_dtype, "probs")
    assert (got_probs[want_indices < 0] == 0).all()
    want_dlogits = eref.softmax_topk_grad(logits, want_indices, dprobs, renormalize)
    got_dlogits = frontend.to_float64(dlogits)
    assert frontend.dtype_of(dlogits) == dtype and got_dlogits.shape == logits.shape
    ref.assert_close(got_dlogits, want_dlogits, dtype, "dlogits")
    if renormalize:  # experts not chosen get exact zeros
        unchosen = np.ones(logits.shape, bool)
        for t, row in enumerate(want_indices):
            unchosen[t, row[row >= 0]] = False
        assert (got_dlogits[unchosen] == 0).all()


def test_a_nan_logit_counts_as_a_masked_expert_in_both_softmax_modes(frontend):
    nan, inf = np.nan, np.inf
    with_nan = np.array([[0.5, nan, 2.0, -1.0, nan], [nan] * 5, [1.0, 3.0, nan, 0.0, -2.0]])
    masked = np.where(np.isnan(with_nan), -inf, with_nan)
    dprobs = np.random.default_rng(8).standard_normal((3, 3))
    for renormalize in (True, False):
        got, want = (frontend.softmax_topk_and_grad(x, 3, renormalize, dprobs, "float32") for x in (with_nan, masked))
        for what, a, b in zip(("probs", "expert_indices", "dlogits"), got, want):
            assert_same_bits(frontend.to_float64(a), frontend.to_float64(b), what)
        probs = frontend.to_float64(got[0])
        assert np.isfinite(probs).all() and np.isfinite(frontend.to_float64(got[2])).all()
        want_probs, _ = eref.softmax_topk(with_nan, 3, renormalize)
        ref.assert_close(probs, want_probs, "float32", "probs")
        if not renormalize:  # the full softmax leaves out the NaN logits as it does -inf
            np.testing.assert_allclose(probs[0].sum(), 1.0, rtol=1e-6)


def test_a_plus_inf_logit_gives_its_token_nan_probabilities_as_a_softmax_does(frontend):
    logits = np.array([[np.inf, 1.0, 2.0, 0.0], [0.5, 1.0, 2.0, 0.0]])
    for renormalize in (True, False):
        probs, indices, _ = (frontend.to_float64(a) for a in frontend.softmax_topk_and_grad(
            logits, 2, renormalize, np.ones((2, 2)), "float32"))
        assert np.isnan(probs[0]).all() and indices[0].tolist() == [0, 2]
        assert np.isfinite(probs[1]).all()  # the other tokens keep their values


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "full_softmax"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_topk_tangent_matches_reference_with_exact_zeros(frontend, dtype, renormalize):
    logits = round_to(ROUTER_LOGITS["masked"], dtype)
    tlogits = round_to(np.random.default_rng(9).standard_normal(logits.shape), dtype)
    got = frontend.to_float64(frontend.softmax_topk_tangent(logits, 3, renormalize, tlogits, dtype))
    _, indices = eref.softmax_topk(logits, 3, renormalize)
    want = eref.softmax_topk_tangent(logits, indices, tlogits, renormalize)
    ref.assert_close(got, want, "float64" if dtype == "float64" else "float32", "tprobs")
    assert (got[indices < 0] == 0).all()


def test_softmax_topk_tangent_is_bitwise_identical_in_jax_and_torch():
    logits = ROUTER_LOGITS["random"].astype(np.float32)
    tlogits = np.random.default_rng(10).standard_normal(logits.shape).astype(np.float32)
    for renormalize in (True, False):
        jax_t, torch_t = (fe.to_float64(fe.softmax_topk_tangent(logits, 2, renormalize, tlogits, "float32"))
                          for fe in (jax_frontend, torch_frontend))
        assert_same_bits(jax_t, torch_t, f"tprobs renormalize={renormalize}")


def routing_inputs(r, h=8, seed=0):
    rng = np.random.default_rng(seed)
    t, k = r.shape
    indices = np.asarray(r.indices, np.int32).reshape(t, k)
    return indices, rng.standard_normal((t, h)), rng.standard_normal((t * k, h)), rng.uniform(0.1, 1.0, (t, k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ROUTINGS, ids=IDS)
def test_permute_matches_reference_and_zeroes_dropped_rows(frontend, routing, dtype):
    indices, tokens, dpermuted, _ = routing_inputs(routing)
    tokens, dpermuted = round_to(tokens, dtype), round_to(dpermuted, dtype)
    permuted, sizes, row_map, dtokens = frontend.permute_and_grad(tokens, indices, routing.num_experts, dpermuted,
                                                                  dtype)
    want_permuted, want_sizes, want_map = eref.permute(tokens, indices, routing.num_experts)
    assert np.array_equal(frontend.to_float64(permuted), want_permuted)  # copies: exact, and exact zeros
    assert frontend.dtype_of(sizes) == "int32" and frontend.dtype_of(row_map) == "int32"
    assert np.array_equal(frontend.to_float64(sizes), want_sizes) and np.array_equal(frontend.to_float64(row_map),
                                                                                      want_map)
    ref.assert_close(frontend.to_float64(dtokens), eref.unpermute(dpermuted, want_map), dtype, "dtokens")


@pytest.mark.parametrize("probs_dtype", ["same", "float32", None])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ROUTINGS, ids=IDS)
def test_unpermute_matches_reference_with_every_gradient(frontend, routing, dtype, probs_dtype):
    indices, _, permuted, probs = routing_inputs(routing, seed=1)
    _, _, row_map = eref.permute(np.zeros((len(indices), 1)), indices, routing.num_experts)
    dout = np.random.default_rng(2).standard_normal((len(indices), permuted.shape[1]))
    permuted, dout = round_to(permuted, dtype), round_to(dout, dtype)
    probs_name = dtype if probs_dtype == "same" else probs_dtype
    probs = None if probs_name is None else round_to(probs, probs_name)
    out, dpermuted, dprobs = frontend.unpermute_and_grads(permuted, row_map, probs, dout, dtype, probs_name)
    ref.assert_close(frontend.to_float64(out), eref.unpermute(permuted, row_map, probs), dtype, "out")
    want_dpermuted, want_dprobs = eref.unpermute_grads(dout, permuted, row_map, probs)
    got_dpermuted = frontend.to_float64(dpermuted)
    ref.assert_close(got_dpermuted, want_dpermuted, dtype, "dpermuted")
    referenced = set(row_map[row_map >= 0].tolist())
    assert all((got_dpermuted[r] == 0).all() for r in range(len(got_dpermuted)) if r not in referenced)
    if probs is None:
        assert dprobs is None
    else:
        assert frontend.dtype_of(dprobs) == probs_name
        got_dprobs = frontend.to_float64(dprobs)
        # dprobs is stored in probs' dtype: the coarser of the two sets the tolerance.
        coarser = max((dtype, probs_name), key=lambda name: TOLERANCE[name])
        ref.assert_close(got_dprobs, want_dprobs, coarser, "dprobs")
        assert (got_dprobs[row_map < 0] == 0).all()


ROW_MAPS = {  # name: (row_map [T][k], R): rows named by several slots, entries outside [0, R)
    "one_row_twice": (((0, 0),), 8),
    "rows_shared_across_tokens": (((2, 0), (2, 5), (0, 0)), 6),
    "outside_the_rows": (((0, 6), (-1, 2**31 - 1), (7, 3)), 6),
    "both": (((1, 1), (9, 1), (-3, 4), (4, 4)), 5),
}


@pytest.mark.parametrize("probs_dtype", ["same", "float32", None])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ROW_MAPS)
def test_unpermute_with_any_row_map_matches_reference_forward_and_backward(frontend, name, dtype, probs_dtype):
    row_map, rows = ROW_MAPS[name]
    row_map = np.asarray(row_map, np.int32)
    rng = np.random.default_rng(11)
    permuted, dout = (round_to(rng.standard_normal(s), dtype) for s in ((rows, 8), (len(row_map), 8)))
    probs_name = dtype if probs_dtype == "same" else probs_dtype
    probs = None if probs_name is None else round_to(rng.uniform(0.1, 1.0, row_map.shape), probs_name)
    out, dpermuted, dprobs = frontend.unpermute_and_grads(permuted, row_map, probs, dout, dtype, probs_name)
    ref.assert_close(frontend.to_float64(out), eref.unpermute(permuted, row_map, probs), dtype, "out")
    want_dpermuted, want_dprobs = eref.unpermute_grads(dout, permuted, row_map, probs)
    got_dpermuted = frontend.to_float64(dpermuted)
    ref.assert_close(got_dpermuted, want_dpermuted, dtype, "dpermuted")
    named = eref.maps_to_row(row_map, rows)
    assert all((got_dpermuted[r] == 0).all() for r in range(rows) if r not in set(row_map[named].tolist()))
    if probs is not None:
        coarser = max((dtype, probs_name), key=lambda n: TOLERANCE[n])
        ref.assert_close(frontend.to_float64(dprobs), want_dprobs, coarser, "dprobs")
        assert (frontend.to_float64(dprobs)[~named] == 0).all()


def test_a_row_named_twice_gets_the_derivative_of_the_forward(frontend):
    # The reported case: the forward adds both slots, so d out / d permuted[0] is 0.3 + 0.7.
    permuted = np.random.default_rng(12).standard_normal((8, 3)).astype(np.float32)
    _, dpermuted, _ = frontend.unpermute_and_grads(permuted, np.array([[0, 0]], np.int32),
                                                    np.array([[0.3, 0.7]], np.float32), np.ones((1, 3)),
                                                    "float32", "float32")
    dpermuted = frontend.to_float64(dpermuted)
    assert (dpermuted[0] == 1.0).all() and not dpermuted[1:].any()


def test_unpermute_gradients_match_finite_differences_for_any_row_map(frontend):
    row_map = np.asarray(ROW_MAPS["both"][0], np.int32)
    rng = np.random.default_rng(13)
    with frontend.precision("float64"):
        rows = frontend.array(row_map, "int32")
        frontend.check_float64_gradients(lambda p, q: frontend.unpermute(p, rows, q),
                                         (rng.standard_normal((5, 3)), rng.uniform(0.1, 1.0, row_map.shape)))


def mlp_inputs(sizes, m, dtype, activation, with_bias):
    """x [M, H], w_in [E, F_in, H], w_out [E, H, F], dout [M, H] and the biases (None
    without), rounded to dtype: the expert MLP's test inputs."""
    rng = np.random.default_rng(3)
    e, h, f = len(sizes), 8, 6
    f_in = 2 * f if activation == "swiglu" else f
    x, w_in, w_out, dout = (round_to(rng.standard_normal(s) * scale, dtype) for s, scale in (
        ((m, h), 1.0), ((e, f_in, h), 0.5), ((e, h, f), 0.5), ((m, h), 1.0)))
    b_in, b_out = ((round_to(rng.standard_normal((e, f_in)), dtype), round_to(rng.standard_normal((e, h)), dtype))
                   if with_bias else (None, None))
    return x, w_in, w_out, dout, b_in, b_out


MLP_CASES = [  # name, group sizes, M (rows past the sum are padding)
    ("uniform", (3, 3, 3), 9),
    ("one_expert_empty", (4, 0, 3), 9),
    ("every_expert_empty", (0, 0, 0), 5),
    ("no_rows", (0, 0, 0), 0),
]


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "relu", "silu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, sizes, m", MLP_CASES, ids=[c[0] for c in MLP_CASES])
def test_grouped_mlp_matches_reference_with_every_gradient(frontend, name, sizes, m, dtype, activation, with_bias):
    e = len(sizes)
    x, w_in, w_out, dout, b_in, b_out = mlp_inputs(sizes, m, dtype, activation, with_bias)
    y, grads = frontend.grouped_mlp_and_grads(x, w_in, w_out, sizes, activation, b_in, b_out, dout, dtype)
    want_y, want_grads = eref.grouped_mlp_and_grads(x, w_in, w_out, sizes, activation, b_in, b_out, dout,
                                                     lambda a: round_to(a, dtype))
    ref.assert_close(frontend.to_float64(y), want_y, dtype, "y")
    pad = ref.padding_rows(sizes, m, e)
    assert (frontend.to_float64(y)[pad] == 0).all()
    for what, got, want in zip(("dx", "dw_in", "dw_out", "db_in", "db_out"), grads, want_grads):
        if what.startswith("db") and not with_bias:
            assert got is None
            continue
        got = frontend.to_float64(got)
        assert got.shape == want.shape, what
        ref.assert_close(got, want, dtype, what)
        if what == "dx":
            assert (got[pad] == 0).all()
        else:
            for g in ref.empty_groups(sizes, m, e):
                assert (got[g] == 0).all(), (what, g)


def expert_layer_in_both_frameworks(dtype, device="cpu"):
    """permute -> GroupedMLP -> unpermute with one routing in JAX and in PyTorch: per
    framework, every output and gradient as float64 NumPy (same order in both)."""
    rng = np.random.default_rng(4)
    indices = np.asarray([[1, 0], [2, 2], [0, -1], [1, 3], [2, 0]], np.int32)  # 3 experts, two dropped slots
    tokens = round_to(rng.standard_normal((5, 8)), dtype)
    probs = round_to(rng.uniform(0.1, 1.0, (5, 2)), dtype)
    w_in, w_out = (round_to(rng.standard_normal(s) * 0.5, dtype) for s in ((3, 12, 8), (3, 8, 6)))
    dy = round_to(rng.standard_normal((10, 8)), dtype)
    results = []
    for fe in (jax_frontend, torch_frontend):
        permuted, sizes, row_map, _ = fe.permute_and_grad(tokens, indices, 3, np.zeros((10, 8)), dtype, device=device)
        permuted, sizes, row_map = (fe.to_float64(a) for a in (permuted, sizes, row_map))
        y, grads = fe.grouped_mlp_and_grads(permuted, w_in, w_out, sizes, "swiglu", None, None, dy, dtype,
                                            device=device)
        out, dpermuted, dprobs = fe.unpermute_and_grads(fe.to_float64(y), row_map.astype(np.int32), probs,
                                                        np.ones((5, 8)), dtype, dtype, device=device)
        results.append([fe.to_float64(a) for a in (y, *grads[:3], out, dpermuted, dprobs)] + [permuted])
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_expert_layer_is_bitwise_identical_in_jax_and_torch(dtype):
    for i, (a, b) in enumerate(zip(*expert_layer_in_both_frameworks(dtype))):
        assert_same_bits(a, b, f"result {i}")


def moe_block_in_both_frameworks(device="cpu"):
    """examples/moe_block.py's block (router, permute, GroupedMLP, unpermute), an
    expert masked off, in JAX and in PyTorch from one init: per framework the output,
    group sizes and every gradient as float64 NumPy (same order in both)."""
    import jax
    import torch
    from moe_block import init_block, jax_block, torch_block_class

    rng = np.random.default_rng(7)
    params = init_block(rng, 16, 8, 6)
    x, dy = (rng.standard_normal((20, 16)).astype(np.float32) for _ in range(2))
    allowed = np.arange(6) != 4
    with jax.default_device(jax.devices("gpu" if device == "cuda" else "cpu")[0]):
        (y_j, sizes_j), vjp = jax.vjp(lambda p, x: jax_block(p, x, 2, allowed), params, x)
        dparams_j, dx_j = vjp((dy, np.zeros(sizes_j.shape, jax.dtypes.float0)))
    block = torch_block_class()(params, 2).to(device)
    x_t = torch.tensor(x, device=device, requires_grad=True)
    y_t, sizes_t = block(x_t, torch.tensor(allowed, device=device))
    y_t.backward(torch.tensor(dy, device=device))
    jax_results = [y_j, sizes_j, dx_j, dparams_j["router"], dparams_j["w_in"], dparams_j["w_out"]]
    torch_results = [y_t, sizes_t, x_t.grad, block.router.grad, block.experts.fc1.weight.grad,
                     block.experts.fc2.weight.grad]
    return [[fe.to_float64(a) for a in results]
            for fe, results in ((jax_frontend, jax_results), (torch_frontend, torch_results))]


def test_moe_block_is_bitwise_identical_in_jax_and_torch():
    jax_results, torch_results = moe_block_in_both_frameworks()
    assert jax_results[1][4] == 0 and (jax_results[4][4] == 0).all()  # the masked expert: no rows, zero grad
    for what, a, b in zip(("y", "group_sizes", "dx", "drouter", "dw_in", "dw_out"), jax_results, torch_results):
        assert_same_bits(a, b, what)


@pytest.mark.parametrize("call, error, match", [
    (lambda f, a: f.permute(a.lhs, a.sizes, 3), ValueError, "expert_indices must be 2-D"),
    (lambda f, a: f.permute(a.lhs, a.cast(a.lhs, "float32"), 3), TypeError, "expert_indices must be an integer"),
    (lambda f, a: f.permute(a.lhs, a.array([[0]] * 5, "int32"), 3), ValueError,
     "expert_indices has 5 rows but tokens has 6"),
    (lambda f, a: f.permute(a.lhs, a.array([[0]] * 6, "int32"), -1), ValueError,
     "num_experts must be a non-negative int"),
    (lambda f, a: f.permute(a.lhs, a.array([[0]] * 6, "int32"), 2**40), ValueError,
     r"num_experts = 1099511627776 exceeds 2147483646 \(expert ids and group sizes are int32\)"),
    (lambda f, a: f.shape_only(lambda t, i: f.permute(t, i, 4), ((2**30, 4), "float32"), ((2**30, 2), "int32")),
     ValueError, r"expert_indices has T \* k = 1073741824 \* 2 slots, more than row_map's int32 rows"),
    (lambda f, a: f.shape_only(lambda p, r: f.unpermute(p, r), ((8, 4), "float32"), ((2**29, 4), "int32")),
     ValueError, r"row_map has T \* k = 536870912 \* 4 slots"),
    (lambda f, a: f.shape_only(lambda x: f.softmax_topk(x, 1), ((1, 2**31), "bfloat16")), ValueError,
     "logits has 2147483648 experts; expert_indices are int32"),
    (lambda f, a: f.permute(a.cast(a.lhs, "int32"), a.array([[0]] * 6, "int32"), 3), TypeError,
     "tokens must be float32"),
    (lambda f, a: f.unpermute(a.lhs, a.array([[0, 1]] * 3, "int64")), TypeError, "row_map must be int32"),
    (lambda f, a: f.unpermute(a.lhs[0], a.array([[0, 1]] * 3, "int32")), ValueError, "permuted must be 2-D"),
    (lambda f, a: f.unpermute(a.lhs, a.array([[0, 1]] * 3, "int32"), a.array(np.ones((3, 3)), "float32")),
     ValueError, r"probs must have shape \(3, 2\)"),
    (lambda f, a: f.unpermute(a.lhs, a.array([[0, 1]] * 3, "int32"), a.array(np.ones((3, 2)), "float16")),
     TypeError, "probs must be float32, got float16"),
    (lambda f, a: f.mlp_with_activation("tanh"), ValueError, "activation must be one of 'swiglu', 'gelu'"),
    (lambda f, a: f.softmax_topk(a.lhs, 5), ValueError, r"k = 5 exceeds the 4 experts"),
    (lambda f, a: f.softmax_topk(a.lhs, -1), ValueError, "k must be a non-negative int"),
    (lambda f, a: f.softmax_topk(a.lhs[0], 1), ValueError, r"logits must be 2-D \[T, E\]"),
    (lambda f, a: f.softmax_topk(a.cast(a.lhs, "int32"), 1), TypeError, "logits must be float32"),
    (lambda f, a: f.softmax_topk(a.lhs, 1, renormalize=None), TypeError, "renormalize must be a bool"),
])
def test_bad_expert_layer_input_raises_naming_the_argument(frontend, call, error, match):
    with pytest.raises(error, match=match):
        with frontend.precision("float64"):  # JAX: int64 row maps need x64
            call(frontend, base_arguments(frontend))


@pytest.mark.parametrize("change, error, match", [
    (dict(b_out=((2, 4), "float32")), ValueError, r"grouped_mlp: b_out must have shape \(2, 2\), got \(2, 4\)"),
    (dict(b_in=((2, 4), "bfloat16")), TypeError, "grouped_mlp: b_in dtype bfloat16 differs from x dtype float32"),
    (dict(w_out=((2, 2, 2), "bfloat16")), TypeError, "grouped_mlp: w_out dtype bfloat16 differs from x dtype float32"),
    (dict(group_sizes=((2,), "float32")), TypeError, "grouped_mlp: group_sizes must be an integer array"),
])
def test_jax_grouped_mlp_names_its_own_arguments(change, error, match):
    import jax.numpy as jnp

    import groupgemm.jax as gj

    arguments = {"x": ((2, 2), "float32"), "w_in": ((2, 2, 4), "float32"), "w_out": ((2, 2, 2), "float32"),
                 "group_sizes": ((2,), "int32"), **change}
    arrays = {name: jnp.ones(shape, dtype) for name, (shape, dtype) in arguments.items()}
    with pytest.raises(error, match=match):
        gj.grouped_mlp(arrays.pop("x"), arrays.pop("w_in"), arrays.pop("w_out"), arrays.pop("group_sizes"), **arrays)


@pytest.mark.parametrize("layout", ["to_sparse", "to_mkldnn"])
def test_torch_expert_layer_refuses_tensors_that_are_not_dense_naming_them(layout):
    import torch
    tokens, indices = getattr(torch.randn(6, 4), layout)(), torch.zeros(6, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="permute: tokens must be a dense tensor"):
        torch_frontend.permute(tokens, indices, 3)
    with pytest.raises(TypeError, match="softmax_topk: logits must be a dense tensor"):
        torch_frontend.softmax_topk(tokens, 2)
