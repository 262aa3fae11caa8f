"""Under jax.jit with sharded inputs on 4 CPU devices, groupgemm's JAX ops partition
themselves (jax_ext/partitioning.py): in the compiled program each device's custom call
sees only its shard, no weight or token array is all-gathered, and the only collectives
are the ones the layout needs. Values and gradients match the float64 reference, and the
unsharded call bit for bit where each device runs the unsharded call's GEMMs."""

import functools

import expert_reference as expert_ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from bits import assert_same_bits, bf16_ulps, cancelling
from hlo import collective_types, collectives, compiled_text, custom_calls, mesh_axis_groups
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import cpu_mesh

import groupgemm.jax as gj

M, K, N = 16, 8, 12
SIZES = (5, 0, 6, 3)  # an empty expert, two padding rows; 4-row blocks cut through groups
WINDOW_SIZES = (2, 4, 0, 3, 5, 1, 0, 1)  # group_offset 2 picks global experts 2..5
MATMUL, WGRAD, BIAS_GRAD = "groupgemm_matmul", "groupgemm_wgrad", "groupgemm_bias_grad"
BACKWARD = "groupgemm_matmul_backward"  # a matmul's dlhs, drhs and dbias from one call


def mesh_1d():
    return cpu_mesh((4,), ("x",))


def mesh_2d(names):
    return cpu_mesh((2, 2), names)


def put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def data(seed=0):
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    return dict(lhs=f32(M, K), rhs=f32(4, K, N), bias=f32(4, N), dout=f32(M, N), acc=f32(4, K, N))


def no_gathers(text):
    gathers = collectives(text, "all-gather")
    assert not gathers, f"all-gathers: {gathers}"


def reduced(text):
    """The result shapes of every all-reduce."""
    return [shape for shapes, _ in collectives(text, "all-reduce") for shape in shapes]


def operands_of(text, target):
    calls = custom_calls(text, target)
    assert calls, f"no {target} call"
    return [operands for _, operands in calls]


def results_of(text, target):
    return [results[0] for results, _ in custom_calls(text, target)]


def weight_gradients(text):
    """The shapes of the weight gradients each device computes: grouped_matmul_wgrad's, and
    the drhs of a matmul's backward (its second result; a placeholder when not wanted)."""
    return results_of(text, WGRAD) + [r[1] for r, _ in custom_calls(text, BACKWARD) if len(r[1]) == 3]


def bias_gradients(text):
    """Likewise for the bias gradients (a backward's third result)."""
    return results_of(text, BIAS_GRAD) + [r[2] for r, _ in custom_calls(text, BACKWARD) if len(r[2]) == 2]


# ---- grouped_matmul: each layout, forward and gradients ------------------------------

# name: lhs spec, rhs spec, bias spec, transpose_rhs, group_offset, the operand shapes of
# each device's forward call (lhs, rhs) and the all-reduces the forward needs.
LAYOUTS = {
    "rows": (P("x"), P(), P(), False, None, ((4, K), (4, K, N)), []),
    "rows_window": (P("x"), P(), P(), False, 2, ((4, K), (4, K, N)), []),
    "n": (P(), P(None, None, "x"), P(None, "x"), False, None, ((M, K), (4, K, 3)), []),
    "n_transposed": (P(), P(None, "x", None), P(None, "x"), True, None, ((M, K), (4, 3, K)), []),
    "k": (P(None, "x"), P(None, "x", None), P(), False, None, ((M, 2), (4, 2, N)), [(M, N)]),
    "experts": (P(), P("x"), P("x"), False, None, ((M, K), (1, K, N)), [(M, N)]),
    "experts_window": (P(), P("x"), P("x"), False, 2, ((M, K), (1, K, N)), [(M, N)]),
}
# Where each device runs exactly the unsharded call's GEMMs (the rest sum differently).
BITWISE = {"experts", "experts_window"}


def _layout_inputs(name):
    lhs_spec, rhs_spec, bias_spec, transpose, offset, _, _ = LAYOUTS[name]
    d = data()
    rhs = d["rhs"].transpose(0, 2, 1).copy() if transpose else d["rhs"]
    sizes = np.asarray(SIZES if offset is None else WINDOW_SIZES, np.int32)
    call = functools.partial(gj.grouped_matmul, transpose_rhs=transpose,
                             group_offset=None if offset is None else jnp.int32(offset))
    mesh = mesh_1d()
    sharded = (put(mesh, d["lhs"], *lhs_spec), put(mesh, rhs, *rhs_spec), put(mesh, d["bias"], *bias_spec))
    return d, rhs, sizes, offset or 0, call, sharded


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grouped_matmul_runs_on_each_devices_shard_and_matches_the_reference(name):
    _, _, _, transpose, _, shard_shapes, forward_reduces = LAYOUTS[name]
    d, rhs, sizes, offset, call, (lhs_s, rhs_s, bias_s) = _layout_inputs(name)
    forward = jax.jit(lambda lhs, rhs, bias, sizes: call(lhs, rhs, sizes, bias=bias))
    out = forward(lhs_s, rhs_s, bias_s, sizes)

    expected = ref.grouped_matmul(d["lhs"], rhs, sizes, d["bias"], transpose, offset)
    ref.assert_close(out, expected, "float32", name)
    padding = ref.padding_rows(sizes, M, 4, offset)
    assert (np.asarray(out)[padding] == 0).all()
    if name in BITWISE:
        assert_same_bits(out, call(d["lhs"], rhs, sizes, bias=d["bias"]), name)

    text = compiled_text(forward, lhs_s, rhs_s, bias_s, sizes)
    no_gathers(text)
    assert [ops[:2] for ops in operands_of(text, MATMUL)] == [list(shard_shapes)]
    assert reduced(text) == forward_reduces


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grouped_matmul_gradients_are_computed_where_their_shards_live(name):
    _, _, _, transpose, _, _, _ = LAYOUTS[name]
    d, rhs, sizes, offset, call, sharded = _layout_inputs(name)
    dout = d["dout"]
    loss = lambda lhs, rhs, bias: jnp.sum(call(lhs, rhs, sizes, bias=bias) * dout)  # noqa: E731
    # Gradients stay where their parameters live, as a training step's update keeps them.
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), out_shardings=tuple(x.sharding for x in sharded))
    dlhs, drhs, dbias = grad(*sharded)

    expect_drhs = ref.grouped_matmul_wgrad(d["lhs"], dout, sizes, 4, offset)
    ref.assert_close(dlhs, ref.grouped_matmul(dout, rhs, sizes, None, not transpose, offset), "float32", "dlhs")
    ref.assert_close(drhs, expect_drhs.transpose(0, 2, 1) if transpose else expect_drhs, "float32", "drhs")
    ref.assert_close(dbias, ref.grouped_bias_grad(dout, sizes, 4, offset), "float32", "dbias")
    for g in ref.empty_groups(sizes, M, 4, offset):
        assert (np.asarray(drhs)[g] == 0).all() and (np.asarray(dbias)[g] == 0).all()
    if name in BITWISE:
        for got, want, what in zip((dlhs, drhs, dbias), jax.grad(loss, argnums=(0, 1, 2))(d["lhs"], rhs, d["bias"]),
                                   ("dlhs", "drhs", "dbias")):
            assert_same_bits(got, want, what)

    text = compiled_text(grad, *sharded)
    no_gathers(text)
    assert weight_gradients(text) == [sharded[1].sharding.shard_shape(rhs.shape)]
    if name.startswith("experts"):  # each device's experts' gradients, where they live: no collective
        assert bias_gradients(text) == [(1, N)]
        assert all(len(shape) < 3 for shape in reduced(text)), reduced(text)


# ---- grouped_matmul_wgrad -------------------------------------------------------------


@pytest.mark.parametrize("name, specs, out_spec, call_shapes, reduces", [
    ("rows", (P("x"), P("x")), P(), ((4, K), (4, N)), [(4, K, N)]),  # data parallel: one all-reduce
    ("experts", (P(), P()), P("x"), ((M, K), (M, N)), []),  # each device its experts, no collective
    ("k", (P(None, "x"), P()), P(None, "x"), ((M, 2), (M, N)), []),  # each device its K slice of every expert
])
@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulate"])
def test_wgrad_partitions_and_counts_the_accumulator_once(name, specs, out_spec, call_shapes, reduces, accumulate):
    d, mesh = data(), mesh_1d()
    sizes = np.asarray(SIZES, np.int32)
    lhs, grad = put(mesh, d["lhs"], *specs[0]), put(mesh, d["dout"], *specs[1])
    acc = put(mesh, d["acc"], *out_spec) if accumulate else None
    wgrad = jax.jit(lambda lhs, grad, acc: gj.grouped_matmul_wgrad(lhs, grad, sizes, num_groups=4, accumulate_into=acc),
                    out_shardings=NamedSharding(mesh, out_spec))
    out = wgrad(lhs, grad, acc)

    ref.assert_close(out, ref.grouped_matmul_wgrad(d["lhs"], d["dout"], sizes, 4,
                                                   accumulate_into=d["acc"] if accumulate else None), "float32", name)
    assert_same_bits(np.asarray(out)[1], d["acc"][1] if accumulate else np.zeros((K, N), np.float32), "empty group")
    if name == "experts":
        assert_same_bits(out, gj.grouped_matmul_wgrad(d["lhs"], d["dout"], sizes, num_groups=4,
                                                      accumulate_into=d["acc"] if accumulate else None), name)
    text = compiled_text(wgrad, lhs, grad, acc)
    no_gathers(text)
    assert [ops[:2] for ops in operands_of(text, WGRAD)] == [list(call_shapes)]
    assert reduced(text) == reduces


# ---- 16-bit partial sums --------------------------------------------------------------


@pytest.mark.parametrize("split", ["rows", "k", "hidden"])
def test_16_bit_partial_sums_are_summed_in_float32_and_rounded_once(split):
    # Each device's part is its float32 accumulator. Rounded to bfloat16 before the
    # all-reduce, the large parts lost their small sum's bits (3e2 and 1e5 ulps here).
    rng, mesh = np.random.default_rng(3), mesh_1d()
    m, k, n = 64, 32, 24
    sizes = np.asarray((m // 2, m // 2), np.int32)  # each expert's rows span two devices' blocks
    bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    cancelling_bf16 = lambda shape, axis: jnp.asarray(cancelling(rng, shape, axis), jnp.bfloat16)  # noqa: E731
    if split == "rows":  # data parallel: drhs = lhs^T dout and dbias, summed over the devices' rows
        lhs, dout, rhs, bias = bf16(m, k), cancelling_bf16((m, n), 0), bf16(2, k, n), bf16(2, n)

        def step(lhs, dout):
            loss = lambda w, b: jnp.sum(gj.grouped_matmul(lhs, w, sizes, bias=b).astype(jnp.float32)  # noqa: E731
                                        * dout.astype(jnp.float32))
            return jax.grad(loss, argnums=(0, 1))(rhs, bias)

        args = (put(mesh, lhs, "x"), put(mesh, dout, "x"))
        x, dy = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
        want = (np.stack([x[:32].T @ dy[:32], x[32:].T @ dy[32:]]), np.stack([dy[:32].sum(0), dy[32:].sum(0)]))
    elif split == "k":  # row tensor parallel: the forward's products summed over the devices' K slices
        lhs, rhs = cancelling_bf16((m, k), 1), jnp.asarray(1 + 0.01 * rng.standard_normal((2, k, n)), jnp.bfloat16)
        step = lambda lhs, rhs: (gj.grouped_matmul(lhs, rhs, sizes),)  # noqa: E731
        args = (put(mesh, lhs, None, "x"), put(mesh, rhs, None, "x"))
        x, w = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
        want = (np.concatenate([x[:32] @ w[0], x[32:] @ w[1]]),)
    else:  # unpermute's bfloat16 dprobs: dot products over the devices' slices of the hidden dimension
        row_map, probs = jnp.arange(m, dtype=jnp.int32)[:, None], jnp.ones((m, 1), jnp.bfloat16)
        permuted, dout = cancelling_bf16((m, n * 4), 1), jnp.asarray(1 + rng.standard_normal((m, n * 4)), jnp.bfloat16)

        def step(permuted, dout):
            return jax.vjp(lambda p: gj.unpermute(permuted, row_map, p), probs)[1](dout)

        args = (put(mesh, permuted, None, "x"), put(mesh, dout, None, "x"))
        want = ((np.asarray(permuted, np.float64) * np.asarray(dout, np.float64)).sum(1, keepdims=True),)
    step = jax.jit(step)
    for got, expected in zip(step(*args), want):
        assert got.dtype == jnp.bfloat16
        assert bf16_ulps(got, expected) <= 1.0, bf16_ulps(got, expected)
    types = collective_types(compiled_text(step, *args), "all-reduce")
    assert types and all(set(t) == {"f32"} for t in types), types


# ---- the drop-ins ---------------------------------------------------------------------


def test_ragged_dot_gmm_and_tgmm_partition_like_grouped_matmul():
    d, mesh = data(), mesh_1d()
    sizes = np.asarray(SIZES, np.int32)
    rows, experts = put(mesh, d["lhs"], "x"), put(mesh, d["rhs"], "x")
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                             rhs_group_dimensions=[])
    ops = {
        "ragged_dot rows": (lambda x, w: gj.ragged_dot(x, w, sizes), (rows, d["rhs"]),
                            ref.grouped_matmul(d["lhs"], d["rhs"], sizes)),
        "ragged_dot experts": (lambda x, w: gj.ragged_dot(x, w, sizes), (d["lhs"], experts),
                               ref.grouped_matmul(d["lhs"], d["rhs"], sizes)),
        "gmm experts": (lambda x, w: gj.gmm(x, w, sizes), (d["lhs"], experts),
                        ref.grouped_matmul(d["lhs"], d["rhs"], sizes)),
        "ragged_dot_general contracting rows": (
            lambda x, g: gj.ragged_dot_general(x, g, sizes, dims), (rows, put(mesh, d["dout"], "x")),
            ref.grouped_matmul_wgrad(d["lhs"], d["dout"], sizes, 4)),
        "tgmm rows": (lambda x, g: gj.tgmm(x.T, g, sizes), (rows, put(mesh, d["dout"], "x")),
                      ref.grouped_matmul_wgrad(d["lhs"], d["dout"], sizes, 4)),
    }
    for what, (fn, args, expected) in ops.items():
        jitted = jax.jit(fn)
        ref.assert_close(jitted(*args), expected, "float32", what)
        text = compiled_text(jitted, *args)
        no_gathers(text)
        target = WGRAD if expected.ndim == 3 else MATMUL
        first = operands_of(text, target)[0]
        assert first[0][0] == (4 if "rows" in what else M), (what, first)
        assert "experts" not in what or first[1][0] == 1, (what, first)


# ---- the expert layer -----------------------------------------------------------------


def test_router_and_unpermute_run_on_each_devices_tokens():
    rng, mesh = np.random.default_rng(1), mesh_1d()
    t, e, h, k = 16, 6, 8, 2
    logits = rng.standard_normal((t, e)).astype(np.float32)
    tokens = rng.standard_normal((t, h)).astype(np.float32)
    dout = rng.standard_normal((t, h)).astype(np.float32)
    _, experts = gj.softmax_topk(logits, k)
    permuted, _, row_map = gj.permute(tokens, experts, e)

    def layer(logits, permuted, row_map):
        probs, _ = gj.softmax_topk(logits, k)
        return gj.unpermute(permuted, row_map, probs)

    loss = lambda *a: jnp.sum(layer(*a) * dout)  # noqa: E731
    args = (put(mesh, logits, "x"), permuted, put(mesh, row_map, "x"))  # permuted replicated: any row is local
    fwd, grad = jax.jit(layer), jax.jit(jax.grad(loss, argnums=(0, 1)))
    assert_same_bits(fwd(*args), layer(logits, permuted, row_map), "forward")
    for got, want, what in zip(grad(*args), jax.grad(loss, argnums=(0, 1))(logits, permuted, row_map),
                               ("dlogits", "dpermuted")):
        assert_same_bits(got, want, what)
    probs64, experts64 = expert_ref.softmax_topk(logits, k, True)
    np.testing.assert_array_equal(experts, experts64)
    ref.assert_close(fwd(*args), expert_ref.unpermute(np.asarray(permuted), np.asarray(row_map), probs64),
                     "float32", "unpermute")

    tangent = jax.jit(lambda logits, t_logits: jax.jvp(lambda x: gj.softmax_topk(x, k)[0], (logits,), (t_logits,))[1])
    assert_same_bits(tangent(args[0], put(mesh, dout[:, :e], "x")), tangent(logits, dout[:, :e]), "tangent")

    text = compiled_text(fwd, *args) + compiled_text(grad, *args) + compiled_text(tangent, args[0], dout[:, :e])
    no_gathers(text)
    for target, token_operand in (("groupgemm_softmax_topk", 0), ("groupgemm_softmax_topk_backward", 0),
                                  ("groupgemm_softmax_topk_tangent", 0),
                                  ("groupgemm_unpermute", 1)):  # unpermute: each device's row_map
        assert all(ops[token_operand][0] == t // 4 for ops in operands_of(text, target)), target
    # Each device scatters its tokens' rows into dpermuted (one all-reduce sums it) and takes its
    # tokens' dots for dprobs: two calls of unpermute's backward, each on the device's dout.
    backward = custom_calls(text, "groupgemm_unpermute_backward")
    assert sorted((ops[0], results[:2]) for results, ops in backward) == [
        ((t // 4, h), [(0,), (t // 4, k)]), ((t // 4, h), [(t * k, h), (0,)])]
    assert reduced(compiled_text(grad, *args)) == [(t * k, h)]


def test_permute_keeps_a_sharded_hidden_dimension_local():
    rng, mesh = np.random.default_rng(2), mesh_1d()
    tokens = rng.standard_normal((6, 8)).astype(np.float32)
    experts = np.asarray([[0, 2], [2, 2], [0, -1], [1, 2], [0, 1], [2, 0]], np.int32)

    def layer(tokens):
        permuted, sizes, row_map = gj.permute(tokens, experts, 3)
        return gj.unpermute(permuted * 2, row_map), sizes

    jitted = jax.jit(layer)
    args = (put(mesh, tokens, None, "x"),)
    for got, want in zip(jitted(*args), layer(tokens)):
        assert_same_bits(got, want, "permute")
    text = compiled_text(jitted, *args)
    no_gathers(text)
    assert [ops[0] for ops in operands_of(text, "groupgemm_permute")] == [(6, 2)]


def test_unpermute_gradients_keep_a_sharded_hidden_dimension_local():
    """dpermuted takes each device's hidden columns by themselves; each dprobs dot is a
    partial sum over them, which one all-reduce completes."""
    rng, mesh = np.random.default_rng(3), mesh_1d()
    t, k, h = 6, 2, 8
    permuted = rng.standard_normal((t * k, h)).astype(np.float32)
    row_map = np.asarray([[3, 0], [7, 7], [-1, 11], [2, 5], [9, 1], [4, 12]], np.int32)  # a row twice, dropped slots
    probs = rng.random((t, k)).astype(np.float32)
    dout = rng.standard_normal((t, h)).astype(np.float32)
    loss = lambda p, q, d: jnp.sum(gj.unpermute(p, row_map, q) * d)  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    args = (put(mesh, permuted, None, "x"), probs, put(mesh, dout, None, "x"))
    dpermuted, dprobs = grad(*args)

    want_dpermuted, want_dprobs = expert_ref.unpermute_grads(dout, permuted, row_map, probs)
    assert_same_bits(dpermuted, jax.grad(loss)(permuted, probs, dout), "dpermuted")
    ref.assert_close(dpermuted, want_dpermuted, "float32", "dpermuted")
    ref.assert_close(dprobs, want_dprobs, "float32", "dprobs")
    text = compiled_text(grad, *args)
    no_gathers(text)
    assert [ops[0] for ops in operands_of(text, "groupgemm_unpermute_backward")] == [(t, h // 4)] * 2
    assert reduced(text) == [(t, k)]


# ---- the grouped MLP on 2-D meshes ----------------------------------------------------


def mlp_inputs(seed, e=4, h=8, f=8, gated=False):
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: (rng.standard_normal(shape) / 2).astype(np.float32)  # noqa: E731
    return f32(M, h), f32(e, h, 2 * f if gated else f), f32(e, f, h), f32(M, h)


def mlp_grads_on_mesh(mesh, inputs, specs, activation):
    """The grouped MLP's loss and gradients, jitted with the inputs sharded by ``specs``
    (one per x, w_in, w_out) and the gradients kept so, checked against the float64
    reference; returns the compiled HLO text."""
    x, w_in, w_out, dout = inputs
    sizes = np.asarray(SIZES, np.int32)
    loss = lambda x, w_in, w_out: jnp.sum(gj.grouped_mlp(x, w_in, w_out, sizes, activation=activation) * dout)  # noqa: E731
    args = tuple(put(mesh, a, *spec) for a, spec in zip((x, w_in, w_out), specs))
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), out_shardings=(None, tuple(a.sharding for a in args)))
    value, grads = grad(*args)

    y, (dx, dw_in, dw_out, _, _) = expert_ref.grouped_mlp_and_grads(
        x, w_in.transpose(0, 2, 1), w_out.transpose(0, 2, 1), sizes, activation, None, None, dout)
    ref.assert_close(value, np.sum(y * dout), "float32", "loss")
    for got, want, what in zip(grads, (dx, dw_in.transpose(0, 2, 1), dw_out.transpose(0, 2, 1)),
                               ("dx", "dw_in", "dw_out")):
        ref.assert_close(got, want, "float32", what)
    return compiled_text(grad, *args)


def test_grouped_mlp_on_data_by_tensor_mesh_splits_columns_then_rows():
    """Megatron's tensor parallelism: fc1 column-parallel, the activation on each device's
    columns, fc2 row-parallel with one all-reduce; tokens sharded over data."""
    text = mlp_grads_on_mesh(mesh_2d(("data", "tensor")), mlp_inputs(3),
                             (("data",), (None, None, "tensor"), (None, "tensor")), "gelu")
    no_gathers(text)
    assert all(ops[0][0] == M // 2 for ops in operands_of(text, MATMUL))  # each device its tokens
    assert all(ops[0] == (M // 2, 4) for ops in operands_of(text, "groupgemm_activation"))  # and its columns
    assert sorted(weight_gradients(text)) == [(4, 4, 8), (4, 8, 4)]  # each device its F columns of w_in, w_out


def test_grouped_mlp_on_data_by_expert_mesh_runs_each_devices_tokens_through_its_experts():
    """Tokens over data, experts over expert: each device multiplies its tokens by its
    experts (group sizes of its rows, its window of experts); the partial outputs meet in
    all-reduces over expert, the weight gradients, computed where their experts live, in
    all-reduces over data."""
    mesh = mesh_2d(("data", "expert"))
    text = mlp_grads_on_mesh(mesh, mlp_inputs(7, gated=True), (("data",), ("expert",), ("expert",)), "swiglu")
    no_gathers(text)
    assert all(ops[0][0] == M // 2 and ops[1][0] == 2 for ops in operands_of(text, MATMUL))
    assert sorted(weight_gradients(text)) == [(2, 8, 8), (2, 8, 16)]
    expert_groups, data_groups = mesh_axis_groups(mesh, "expert"), mesh_axis_groups(mesh, "data")
    for shapes, groups in collectives(text, "all-reduce"):
        assert groups == (data_groups if any(len(s) == 3 for s in shapes) else expert_groups), (shapes, groups)


def moe_block(x, router, w_in, w_out):
    """The MoE block of examples/moe_block.py for one routing group ``x [T, H]``."""
    logits = gj.grouped_matmul(x, router[None], jnp.array([x.shape[0]], jnp.int32))
    probs, experts = gj.softmax_topk(logits, 2)
    permuted, sizes, row_map = gj.permute(x, experts, router.shape[1])
    y = gj.grouped_mlp(permuted, w_in, w_out, sizes, activation="swiglu")
    return gj.unpermute(y, row_map, probs)


def moe_reference(x, router, w_in, w_out):
    """moe_block in float64 NumPy."""
    probs, experts = expert_ref.softmax_topk(np.asarray(x, np.float64) @ router, 2, True)
    permuted, sizes, row_map = expert_ref.permute(x, experts, router.shape[1])
    h = ref.grouped_matmul(permuted, w_in, sizes)
    y = ref.grouped_matmul(expert_ref.activation(h, "swiglu"), w_out, sizes)
    return expert_ref.unpermute(y, row_map, probs)


def test_moe_block_on_data_by_expert_mesh_keeps_tokens_and_experts_on_their_devices():
    """Routing groups (vmap over a leading axis, GShard's groups) sharded over data, experts
    over expert: each device routes its group's tokens and runs its own experts; the expert
    layer's partial outputs meet in all-reduces over expert, and the weight gradients, each
    computed where its experts live, in one all-reduce over data."""
    mesh = mesh_2d(("data", "expert"))
    rng = np.random.default_rng(4)
    groups, t, h, f, e = 2, 6, 8, 8, 4
    x = rng.standard_normal((groups, t, h)).astype(np.float32)
    router = rng.standard_normal((h, e)).astype(np.float32)
    w_in = (rng.standard_normal((e, h, 2 * f)) / 3).astype(np.float32)
    w_out = (rng.standard_normal((e, f, h)) / 3).astype(np.float32)
    dout = rng.standard_normal((groups, t, h)).astype(np.float32)
    block = jax.vmap(moe_block, in_axes=(0, None, None, None))
    loss = lambda *a: jnp.sum(block(*a) * dout)  # noqa: E731
    args = (put(mesh, x, "data"), put(mesh, router), put(mesh, w_in, "expert"), put(mesh, w_out, "expert"))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)),
                   out_shardings=(None, tuple(a.sharding for a in args)))
    value, grads = step(*args)

    out = jax.jit(block)(*args)
    for i in range(groups):
        ref.assert_close(out[i], moe_reference(x[i], router, w_in, w_out), "float32", f"group {i}")
    # Each device runs one group's unbatched calls, as a loop over the groups does; the
    # partial sums over experts add exact zeros, and two groups' weight gradients one sum.
    per_group = [jax.grad(lambda *a, i=i: jnp.sum(moe_block(*a) * dout[i]), argnums=(0, 1, 2, 3))(
        x[i], router, w_in, w_out) for i in range(groups)]
    for i in range(groups):
        assert_same_bits(out[i], moe_block(x[i], router, w_in, w_out), f"group {i}")
    want = (np.stack([g[0] for g in per_group]),) + tuple(per_group[0][j] + per_group[1][j] for j in (1, 2, 3))
    ref.assert_close(value, np.sum(np.asarray(out, np.float64) * dout), "float32", "loss")
    for got, want_grad, what in zip(grads, want, ("dx", "drouter", "dw_in", "dw_out")):
        assert_same_bits(got, want_grad, what)

    text = compiled_text(step, *args)
    no_gathers(text)
    assert [ops[0] for ops in operands_of(text, "groupgemm_permute")] == [(t, h)]
    for ops in operands_of(text, MATMUL):
        assert ops[0][0] in (t, t * 2), ops  # one group's tokens (router), or their top-2 slots
    assert sorted(weight_gradients(text)) == [(1, h, e), (2, f, h), (2, h, 2 * f)]  # each device its experts
    expert_groups, data_groups = mesh_axis_groups(mesh, "expert"), mesh_axis_groups(mesh, "data")
    for shapes, groups_ in collectives(text, "all-reduce"):
        weight_grads = [s for s in shapes if len(s) == 3]
        assert groups_ == (data_groups if weight_grads else expert_groups), (shapes, groups_)


# ---- layouts that fall back to gathering ----------------------------------------------


def test_tokens_and_experts_on_one_axis_gather_the_tokens_and_reduce_scatter_the_outputs():
    """Each device needs every token routed to its experts: Megatron's all-gather dispatch.
    The tokens (and the incoming gradient) are gathered, the experts stay where they are,
    the outputs and the token gradients are reduce-scattered back to the token shards."""
    mesh, d = mesh_1d(), data()
    sizes = np.asarray(SIZES, np.int32)
    loss = lambda lhs, rhs, dout: jnp.sum(gj.grouped_matmul(lhs, rhs, sizes) * dout)  # noqa: E731
    args = (put(mesh, d["lhs"], "x"), put(mesh, d["rhs"], "x"), put(mesh, d["dout"], "x"))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), out_shardings=(None, tuple(a.sharding for a in args[:2])))
    value, grads = step(*args)
    want_value, want_grads = jax.value_and_grad(loss, argnums=(0, 1))(d["lhs"], d["rhs"], d["dout"])
    ref.assert_close(value, np.asarray(want_value, np.float64), "float32", "loss")  # jnp.sum adds in shards
    for got, want, what in zip(grads, want_grads, ("dlhs", "drhs")):
        assert_same_bits(got, want, what)

    text = compiled_text(step, *args)
    assert [shapes for shapes, _ in collectives(text, "all-gather")] == [[(M, K)], [(M, N)]]  # tokens, dout
    assert [shapes for shapes, _ in collectives(text, "reduce-scatter")] == [[(4, N)], [(4, K)]]  # out, dlhs
    assert weight_gradients(text) == [(1, K, N)]
    assert all(len(shape) < 3 for shape in reduced(text))


def test_rows_the_experts_axis_does_not_divide_are_summed_whole_not_reduce_scattered():
    """6 tokens wanted over the 4 devices that hold the experts: the all-gather dispatch's
    reduce-scatter needs equal shards of rows, and failed inside the partitioner; the
    outputs are summed whole instead, with the unsharded call's bits."""
    mesh = mesh_1d()
    rng = np.random.default_rng(7)
    tokens = rng.standard_normal((6, 8)).astype(np.float32)
    w_in, w_out = rng.standard_normal((4, 8, 12)).astype(np.float32), rng.standard_normal((4, 6, 8)).astype(np.float32)
    ids = np.asarray([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, -1]], np.int32)
    probs = rng.random((6, 2)).astype(np.float32)
    sizes = np.asarray([2, 1, 0, 3], np.int32)

    def calls(rows):
        return {"grouped_matmul": lambda x, w: rows(gj.grouped_matmul(rows(x), w, sizes)),
                "expert_mlp": lambda t, a, b: rows(gj.expert_mlp(rows(t), rows(ids), rows(probs), a, b))}

    on_rows = calls(lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P("x"))))
    plain = calls(lambda a: a)
    operands = {"grouped_matmul": (tokens, w_in), "expert_mlp": (tokens, w_in, w_out)}
    for what, args in operands.items():
        sharded = (put(mesh, args[0]), *(put(mesh, w, "x") for w in args[1:]))
        argnums = tuple(range(len(args)))
        for fn, want_fn in ((on_rows[what], plain[what]),
                            (jax.grad(lambda *a, f=on_rows[what]: f(*a).sum(), argnums),
                             jax.grad(lambda *a, f=plain[what]: f(*a).sum(), argnums))):
            for got, want in zip(jax.tree.leaves(jax.jit(fn)(*sharded)), jax.tree.leaves(want_fn(*args))):
                assert_same_bits(got, want, what)


def test_layouts_that_cannot_stay_sharded_gather_and_stay_correct():
    """swiglu on column shards (gate column j pairs with column F + j) and permute on token
    shards (its rows come in expert order over all tokens): XLA gathers, values are exact."""
    mesh = mesh_1d()
    sizes = np.asarray(SIZES, np.int32)
    x, w_in, w_out, _ = mlp_inputs(5, gated=True)
    tokens = np.random.default_rng(6).standard_normal((8, 4)).astype(np.float32)
    experts = np.asarray([[0, 1], [1, 2], [2, 0], [0, -1], [1, 1], [2, 2], [0, 2], [1, 0]], np.int32)
    cases = {
        "swiglu on column shards": (lambda x, a, b: gj.grouped_mlp(x, a, b, sizes),
                                    (x, put(mesh, w_in, None, None, "x"), put(mesh, w_out, None, "x")),
                                    (x, w_in, w_out)),
        "permute on token shards": (lambda t: gj.permute(t, experts, 3), (put(mesh, tokens, "x"),), (tokens,)),
    }
    for what, (fn, sharded, plain) in cases.items():
        jitted = jax.jit(fn)
        for got, want in zip(jax.tree.leaves(jitted(*sharded)), jax.tree.leaves(fn(*plain))):
            if what == "swiglu on column shards":  # fc2's partial sums add in another order
                ref.assert_close(got, want, "float32", what)
            else:
                assert_same_bits(got, want, what)
        assert collectives(compiled_text(jitted, *sharded), "all-gather"), what


# ---- explicit axes: types carry shardings ---------------------------------------------


def test_results_on_explicit_axes_are_typed_with_their_natural_sharding():
    mesh = cpu_mesh((4,), ("x",), jax.sharding.AxisType.Explicit)
    d, sizes = data(), np.asarray(SIZES, np.int32)
    with jax.set_mesh(mesh):
        cases = {  # operands' specs -> the result's spec
            "rows": ((P("x"), P()), P("x", None)),
            "n": ((P(), P(None, None, "x")), P(None, "x")),
            "experts": ((P(), P("x")), P(None, None)),
            "k": ((P(None, "x"), P(None, "x")), P(None, None)),
        }
        for what, ((lhs_spec, rhs_spec), want) in cases.items():
            lhs, rhs = put(mesh, d["lhs"], *lhs_spec), put(mesh, d["rhs"], *rhs_spec)
            loss = lambda lhs, rhs: jnp.sum(gj.grouped_matmul(lhs, rhs, sizes) * d["dout"])  # noqa: E731
            out = jax.jit(lambda lhs, rhs: gj.grouped_matmul(lhs, rhs, sizes))(lhs, rhs)
            assert jax.typeof(out).sharding.spec == want and out.sharding.spec == want, what
            ref.assert_close(out, ref.grouped_matmul(d["lhs"], d["rhs"], sizes), "float32", what)
            grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
            dlhs, drhs = grad(lhs, rhs)  # each typed like its primal
            assert dlhs.sharding.is_equivalent_to(lhs.sharding, 2), what
            assert drhs.sharding.is_equivalent_to(rhs.sharding, 3), what
            ref.assert_close(drhs, ref.grouped_matmul_wgrad(d["lhs"], d["dout"], sizes, 4), "float32", what)
            text = compiled_text(grad, lhs, rhs)
            no_gathers(text)
            assert weight_gradients(text) == [rhs.sharding.shard_shape(rhs.shape)], what

        logits = put(mesh, d["lhs"], "x")
        probs, experts = jax.jit(lambda l: gj.softmax_topk(l, 2))(logits)
        assert jax.typeof(probs).sharding.spec == P("x", None) == jax.typeof(experts).sharding.spec
        wgrad = gj.grouped_matmul_wgrad(put(mesh, d["lhs"], None, "x"), d["dout"], sizes, num_groups=4)
        assert jax.typeof(wgrad).sharding.spec == P(None, "x", None)


def explicit_mesh():
    return cpu_mesh((4,), ("x",), jax.sharding.AxisType.Explicit)


def _batched_ops():
    """Each op of one batch entry, for jax.vmap over a batch axis of 4 entries."""
    d, rng = data(), np.random.default_rng(5)
    sizes = jnp.asarray(SIZES, jnp.int32)
    experts = jnp.asarray(rng.integers(-1, 4, (M, 2)), jnp.int32)
    w_in, w_out = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((4, K, 2 * N), (4, N, K)))
    probs = jnp.asarray(rng.random((M, 2)), jnp.float32)
    return {
        "grouped_matmul": (lambda x: gj.grouped_matmul(x, d["rhs"], sizes), (M, K)),
        "grouped_matmul_wgrad": (lambda x: gj.grouped_matmul_wgrad(x, d["dout"], sizes, num_groups=4), (M, K)),
        "grad": (lambda x: jax.grad(lambda x: jnp.sum(gj.grouped_matmul(x, d["rhs"], sizes) ** 2))(x), (M, K)),
        "softmax_topk": (lambda x: gj.softmax_topk(x, 2), (M, K)),
        "permute_unpermute": (lambda x: gj.unpermute(gj.permute(x, experts, 4)[0], gj.permute(x, experts, 4)[2]),
                              (M, K)),
        "grouped_mlp": (lambda x: gj.grouped_mlp(x, w_in, w_out, sizes), (M, K)),
        "expert_mlp_jvp": (lambda x: jax.jvp(lambda t: gj.expert_mlp(t, experts, probs, w_in, w_out), (x,), (x,)),
                           (M, K)),
        "quantize_fp8": (lambda x: gj.quantize_fp8(x, "rowwise"), (M, K)),
    }


@pytest.mark.parametrize("op", list(_batched_ops()))
def test_vmap_over_a_batch_axis_sharded_on_explicit_axes_matches_the_unsharded_call(op):
    fn, shape = _batched_ops()[op]
    mesh, x = explicit_mesh(), np.random.default_rng(6).standard_normal((4, *shape)).astype(np.float32)
    want = jax.jit(jax.vmap(fn))(x)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.vmap(fn))(put(mesh, x, "x"))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert_same_bits(np.asarray(g), np.asarray(w), op)
        assert jax.typeof(g).sharding.spec[0] == "x", op  # each device its own batch entries


def test_expert_mlp_forward_mode_and_second_order_on_explicit_axes_match_the_unsharded_call():
    """Tokens on the rows (data parallel), then weights on the experts: the expert MLP's
    tangent and backward reshape [T, k] slots to rows, which explicit axes must be told
    how to shard."""
    rng = np.random.default_rng(8)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    tokens, dout, w_in, w_out = f32(M, K), f32(M, K), f32(4, K, 2 * N), f32(4, N, K)
    ids, probs = rng.integers(-1, 4, (M, 2)).astype(np.int32), rng.random((M, 2)).astype(np.float32)

    def jvp(t, i, p, a, b):
        return jax.jvp(lambda t, a: gj.expert_mlp(t, i, p, a, b), (t, a), (t, a))

    def grad_of_grad(t, i, p, a, b):
        first = jax.grad(lambda t, a: jnp.sum(gj.expert_mlp(t, i, p, a, b) * dout), argnums=(0, 1))
        return jax.grad(lambda t, a: sum(jnp.sum(g ** 2) for g in first(t, a)), argnums=(0, 1))(t, a)

    mesh = explicit_mesh()
    for fn in (jvp, grad_of_grad):
        want = jax.jit(fn)(tokens, ids, probs, w_in, w_out)
        with jax.set_mesh(mesh):
            for rows, experts in ((P("x"), P()), (P(), P("x"))):
                got = jax.jit(fn)(*(put(mesh, a, *rows) for a in (tokens, ids, probs)),
                                  *(put(mesh, w, *experts) for w in (w_in, w_out)))
                for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4, err_msg=f"{fn.__name__} {rows} {experts}")


def test_jax_lax_ragged_dot_out_sharding_test_passes_against_groupgemm():
    """jax's own tests/lax_test.py test_ragged_dot_out_sharding and
    test_ragged_dot_general_out_sharding, on groupgemm's drop-ins."""
    mesh = cpu_mesh((1,), ("x",), jax.sharding.AxisType.Explicit)
    dnums = jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])
    calls = {
        "ragged_dot": lambda lhs, rhs, gs: gj.ragged_dot(lhs, rhs, gs, out_sharding=jax.P("x", None)),
        "ragged_dot_general": lambda lhs, rhs, gs: gj.ragged_dot_general(lhs, rhs, gs, dnums,
                                                                         out_sharding=jax.P("x", None)),
    }
    with jax.set_mesh(mesh):
        args = [jnp.ones((16, 4)), jnp.ones((2, 4, 3)), jnp.array([8, 8])]
        for what, call in calls.items():
            def f(lhs, rhs, gs):
                out = call(lhs, rhs, gs)
                assert jax.typeof(out).sharding.spec == jax.P("x", None), what
                return out

            assert f(*args).sharding == NamedSharding(mesh, jax.P("x", None)), what  # eager
            assert jax.jit(f)(*args).sharding == NamedSharding(mesh, jax.P("x", None)), what
            assert "sharding_constraint" in jax.jit(f).lower(*args).as_text(), what
            np.testing.assert_array_equal(jax.jit(f)(*args), np.full((16, 3), 4.0, np.float32))


# ---- eager calls and GSPMD ------------------------------------------------------------


def test_eager_calls_on_sharded_arrays_partition_too():
    mesh, d = mesh_1d(), data()
    sizes = np.asarray(SIZES, np.int32)
    out = gj.grouped_matmul(put(mesh, d["lhs"], "x"), d["rhs"], sizes)
    assert out.sharding.spec == P("x")
    ref.assert_close(out, ref.grouped_matmul(d["lhs"], d["rhs"], sizes), "float32", "eager")
    probs, _ = gj.softmax_topk(put(mesh, d["lhs"], "x"), 2)
    assert probs.sharding.spec == P("x")


def test_gspmd_partitions_rows_and_experts_too():
    """Where Shardy is off (the default before jax 0.7), the same rules run as GSPMD's callbacks."""
    mesh, d = mesh_1d(), data()
    sizes = np.asarray(SIZES, np.int32)
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        for spec_lhs, spec_rhs, call_shapes in ((P("x"), P(), [(4, K), (4, K, N)]), (P(), P("x"), [(M, K), (1, K, N)])):
            args = (put(mesh, d["lhs"], *spec_lhs), put(mesh, d["rhs"], *spec_rhs))
            # GSPMD replicates a result whose sharding is left open; Shardy keeps the call's.
            forward = jax.jit(lambda lhs, rhs: gj.grouped_matmul(lhs, rhs, sizes), out_shardings=args[0].sharding)
            ref.assert_close(forward(*args), ref.grouped_matmul(d["lhs"], d["rhs"], sizes), "float32", "gspmd")
            text = compiled_text(forward, *args)
            no_gathers(text)
            assert [ops[:2] for ops in operands_of(text, MATMUL)] == [call_shapes]
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)


def test_jax_export_of_a_sharded_program_exports_the_unpartitioned_calls():
    """A partitioning callback cannot be serialised: exported, the calls gather, as before."""
    from jax import export

    from groupgemm import _core

    mesh, d = mesh_1d(), data()
    sizes = np.asarray(SIZES, np.int32)
    shardings = (NamedSharding(mesh, P("x")), NamedSharding(mesh, P()))
    forward = jax.jit(lambda lhs, rhs: gj.grouped_matmul(lhs, rhs, sizes), in_shardings=shardings)
    checks = [export.DisabledSafetyCheck.custom_call(name) for name in _core.ffi_handlers()["cpu"]]
    exported = export.export(forward, disabled_checks=checks)(
        jax.ShapeDtypeStruct((M, K), jnp.float32), jax.ShapeDtypeStruct((4, K, N), jnp.float32))
    assert "CustomSPMDPartitioning" not in exported.mlir_module()
    out = jax.jit(exported.call, in_shardings=shardings)(d["lhs"], d["rhs"])
    ref.assert_close(out, ref.grouped_matmul(d["lhs"], d["rhs"], sizes), "float32", "exported")
