"""What only groupgemm.jax has: the ragged_dot drop-in against jax.lax.ragged_dot, jit
with traced sizes, vmap, shard_map, Python lists of sizes. No torch here; the shared
bodies are in test_frontends.py."""

import re

import jax
import jax.numpy as jnp
import jax.test_util
import jax_frontend
import numpy as np
import pytest
import reference as ref
from bits import assert_same_bits
from cases import CASES, case, inputs

import groupgemm
import groupgemm.jax as gj
from groupgemm.jax import grouped_matmul, ragged_dot


def _valid_for_lax(c):
    return c.group_offset is None and min(c.group_sizes, default=0) >= 0 and sum(c.group_sizes) <= c.m and c.g > 0


LAX_CASES = [c for c in CASES if _valid_for_lax(c)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", LAX_CASES, ids=[c.name for c in LAX_CASES])
def test_ragged_dot_agrees_with_jax_lax_ragged_dot(case, dtype):
    x = inputs(case)
    lhs, rhs, dout = (jnp.asarray(x[k], dtype) for k in ("lhs", "rhs", "dout"))
    sizes = jnp.asarray(x["group_sizes"])
    ours, our_vjp = jax.vjp(lambda l, r: ragged_dot(l, r, sizes), lhs, rhs)
    theirs, their_vjp = jax.vjp(lambda l, r: jax.lax.ragged_dot(l, r, sizes), lhs, rhs)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    for a, b in [(ours, theirs), *zip(our_vjp(dout), their_vjp(dout))]:
        ref.assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), dtype, case.name)


def test_ragged_dot_accepts_group_offset_where_jax_raises():
    x = inputs(case("window_middle"))
    lhs, rhs = jnp.asarray(x["lhs"], jnp.float32), jnp.asarray(x["rhs"], jnp.float32)
    with pytest.raises((NotImplementedError, TypeError)):  # which one depends on the JAX version
        jax.jit(lambda o: jax.lax.ragged_dot(lhs, rhs, jnp.asarray(x["group_sizes"]), group_offset=o))(
            jnp.array([2], jnp.int32))
    out = ragged_dot(lhs, rhs, jnp.asarray(x["group_sizes"]), group_offset=jnp.array([2], jnp.int32))
    ref.assert_close(np.asarray(out, np.float64),
                     ref.grouped_matmul(x["lhs"], x["rhs"], x["group_sizes"], group_offset=2), "float32")


def test_jit_with_traced_group_sizes_compiles_once():
    traces = []

    @jax.jit
    def f(lhs, rhs, sizes):
        traces.append(1)
        return grouped_matmul(lhs, rhs, sizes)

    x = inputs(case("uniform"))
    lhs, rhs = jnp.asarray(x["lhs"], jnp.float32), jnp.asarray(x["rhs"], jnp.float32)
    for sizes in ([6, 6, 6, 6], [24, 0, 0, 0], [0, 0, 0, 0], [1, 2, 3, 4]):
        out = f(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        ref.assert_close(np.asarray(out, np.float64), ref.grouped_matmul(x["lhs"], x["rhs"], sizes), "float32")
    assert len(traces) == 1


def test_python_list_sizes_of_any_magnitude_are_clipped_like_arrays():
    x = inputs(case("uniform"))
    lhs, rhs = jnp.asarray(x["lhs"], jnp.float32), jnp.asarray(x["rhs"], jnp.float32)
    out = grouped_matmul(lhs, rhs, [-(2**70), 2**70, 5, 2**40])  # as [0, 24, 0, 0]: group 1 owns every row
    ref.assert_close(np.asarray(out, np.float64), ref.grouped_matmul(x["lhs"], x["rhs"], [0, 24, 0, 0]), "float32")


def test_an_empty_python_list_is_the_sizes_of_no_groups():
    # NumPy reads [] as float64; it holds no size, so no dtype to refuse.
    lhs = jnp.ones((5, 3), jnp.float32)
    no_experts = (jnp.ones((0, 3, 4), jnp.float32), jnp.ones((0, 2, 4), jnp.float32))
    assert (grouped_matmul(lhs, no_experts[0], []) == 0).all()
    assert gj.grouped_matmul_wgrad(lhs, jnp.ones((5, 2)), (), num_groups=0).shape == (0, 3, 2)
    assert (gj.grouped_mlp(jnp.ones((5, 4)), jnp.ones((0, 4, 4)), no_experts[1], [], activation="swiglu") == 0).all()
    groupgemm.check_group_sizes([], 0)


def test_numpy_64_bit_integers_are_taken_where_they_fit_and_refused_where_jax_would_wrap_them():
    assert not jax.config.jax_enable_x64  # JAX then holds 32-bit integers only
    x = inputs(case("uniform"))
    lhs, rhs = jnp.asarray(x["lhs"], jnp.float32), jnp.asarray(x["rhs"], jnp.float32)
    want = ref.grouped_matmul(x["lhs"], x["rhs"], [0, 24, 0, 0])
    for dtype in (np.int64, np.uint64):
        ref.assert_close(np.asarray(grouped_matmul(lhs, rhs, np.array([0, 24, 0, 0], dtype)), np.float64), want,
                         "float32", np.dtype(dtype).name)
    huge = np.array([[2**32 + 1, 0], [1, 0]])  # int64; wrapped, 2**32 + 1 would be expert 1
    tokens, w_in, w_out = jnp.ones((2, 4)), jnp.ones((2, 4, 6)), jnp.ones((2, 3, 4))
    calls = [
        ("group_sizes", lambda: grouped_matmul(lhs, rhs, np.array([2**32 + 1, 0, 0, 0], np.uint64))),
        ("group_offset", lambda: grouped_matmul(lhs, rhs, [6, 6, 6, 6], group_offset=np.array(2**32))),
        ("expert_indices", lambda: gj.permute(tokens, huge, 2)),
        ("expert_indices", lambda: gj.expert_mlp(tokens, huge, None, w_in, w_out)),
        ("row_map", lambda: gj.unpermute(tokens, huge)),
    ]
    for name, call in calls:
        with pytest.raises(ValueError, match=f"{name} holds values outside int32's range"):
            call()


def test_vmap_over_a_batch_axis_matches_per_example_calls():
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((3, 12, 8)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 4, 8, 5)), jnp.float32)
    sizes = jnp.asarray([[3, 3, 3, 3], [0, 12, 0, 0], [0, 0, 0, 0]], jnp.int32)
    batched = jax.vmap(grouped_matmul)(lhs, rhs, sizes)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(grouped_matmul(lhs[i], rhs[i], sizes[i])))
    grads = jax.vmap(jax.grad(lambda l, r, s: grouped_matmul(l, r, s).sum(), argnums=1))(lhs, rhs, sizes)
    assert (np.asarray(grads[2]) == 0).all()  # every group empty in example 2


@pytest.mark.parametrize("batch", [3, 12])  # 12: lhs's row count, where a misplaced batch axis fits
def test_vmap_of_a_tangent_along_an_unbatched_direction_matches_per_example_calls(batch):
    # jvp inside vmap: the term t_lhs @ rhs reads no batched operand, so it has no batch
    # axis, while the term lhs @ t_rhs and the second-order ones do.
    rng = np.random.default_rng(3)
    lhs = jnp.asarray(rng.standard_normal((batch, 12, 8)), jnp.float32)
    rhs, t_rhs = (jnp.asarray(rng.standard_normal((4, 8, 5)), jnp.float32) for _ in range(2))
    t_lhs = jnp.asarray(rng.standard_normal((12, 8)), jnp.float32)
    sizes = jnp.asarray([3, 0, 7, 2], jnp.int32)
    loss = lambda l: jnp.sum(grouped_matmul(l, rhs, sizes) ** 2)  # noqa: E731
    per_example = {
        "t_lhs": lambda l: jax.jvp(lambda l: grouped_matmul(l, rhs, sizes), (l,), (t_lhs,))[1],
        "t_lhs and t_rhs": lambda l: jax.jvp(lambda l, r: grouped_matmul(l, r, sizes), (l, rhs), (t_lhs, t_rhs))[1],
        "hessian-vector product": lambda l: jax.jvp(jax.grad(loss), (l,), (t_lhs,))[1],
    }
    for name, f in per_example.items():
        want = np.stack([np.asarray(f(entry)) for entry in lhs])
        np.testing.assert_array_equal(np.asarray(jax.vmap(f)(lhs)), want, err_msg=name)
        np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(f))(lhs)), want, err_msg=name)


def test_expert_parallel_shard_map_with_group_offset_matches_single_device():
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("expert",))
    rng = np.random.default_rng(2)
    sizes = jnp.asarray([5, 0, 7, 4], jnp.int32)  # rank 0 holds experts 0-1, rank 1 experts 2-3
    lhs = jnp.asarray(rng.standard_normal((20, 8)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((4, 8, 6)), jnp.float32)

    def local(lhs, rhs_local, sizes):
        offset = jax.lax.axis_index("expert") * rhs_local.shape[0]
        out = grouped_matmul(lhs, rhs_local, sizes, group_offset=offset)
        return jax.lax.psum(out, "expert")  # padding rows are exact zeros: the sum is exact

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("expert"), P()), out_specs=P()))
    np.testing.assert_array_equal(np.asarray(sharded(lhs, rhs, sizes)), np.asarray(grouped_matmul(lhs, rhs, sizes)))


# ---- the expert layer ---------------------------------------------------------------


def _expert_layer(tokens, indices, probs, w_in, w_out, num_experts):
    permuted, sizes, row_map = gj.permute(tokens, indices, num_experts)
    y = gj.grouped_mlp(permuted, w_in, w_out, sizes, activation="swiglu")
    return gj.unpermute(y, row_map, probs)


def test_expert_layer_under_jit_compiles_once_for_any_routing():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    w_in, w_out = jnp.asarray(rng.standard_normal((3, 8, 12)), jnp.float32), jnp.asarray(
        rng.standard_normal((3, 6, 8)), jnp.float32)
    probs = jnp.full((6, 2), 0.5, jnp.float32)
    traces = []

    @jax.jit
    def step(indices):
        traces.append(1)
        loss = lambda t, a, b: _expert_layer(t, indices, probs, a, b, 3).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(tokens, w_in, w_out)

    for routing in ([[0, 1]] * 6, [[2, 2]] * 6, [[-1, 3]] * 6, [[0, -1], [1, 2], [2, 0], [1, 1], [0, 2], [5, 1]]):
        grads = step(jnp.asarray(routing, jnp.int32))
        used = {e for row in routing for e in row if 0 <= e < 3}
        for e in set(range(3)) - used:  # experts without tokens: exact-zero, full-shape gradients
            assert (np.asarray(grads[1][e]) == 0).all() and (np.asarray(grads[2][e]) == 0).all()
    assert len(traces) == 1


def test_grouped_mlp_takes_either_weight_layout():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((7, 8)), jnp.float32)
    w_in, w_out = jnp.asarray(rng.standard_normal((2, 8, 6)), jnp.float32), jnp.asarray(
        rng.standard_normal((2, 6, 8)), jnp.float32)
    sizes = jnp.asarray([3, 3], jnp.int32)
    jax_layout = gj.grouped_mlp(x, w_in, w_out, sizes, activation="gelu")
    torch_layout = gj.grouped_mlp(x, w_in.transpose(0, 2, 1), w_out.transpose(0, 2, 1), sizes, activation="gelu",
                                  transpose_rhs=True)
    np.testing.assert_allclose(np.asarray(jax_layout), np.asarray(torch_layout), rtol=1e-5, atol=1e-6)
    assert (np.asarray(jax_layout)[6] == 0).all()  # row 6 is padding


@pytest.mark.parametrize("w_in_shape, w_out_shape, match", [
    ((2, 8, 5), (2, 2, 8), "swiglu needs an even w_in output width"),
    ((2, 8, 6), (2, 4, 8), r"w_out must have shape \(2, 3, 8\), got \(2, 4, 8\) \(w_in \(2, 8, 6\) gives 6 "
                           r"outputs, F = 3 under swiglu\)"),  # either weight may be the wrong one: both named
    ((8, 6), (2, 3, 8), "w_in must be 3-D"),
    ((2, 7, 6), (2, 3, 8), r"w_in \(2, 7, 6\) takes inputs of width 7, but x has width 8 \(shape \(4, 8\)\)"),
])
def test_grouped_mlp_checks_its_weight_shapes(w_in_shape, w_out_shape, match):
    with pytest.raises(ValueError, match=match):
        gj.grouped_mlp(jnp.ones((4, 8)), jnp.ones(w_in_shape), jnp.ones(w_out_shape), jnp.asarray([2, 2]))


# ---- autodiff beyond first-order reverse mode ----------------------------------------

# Second-order finite differences cost more: a few groups of a few rows.
AUTODIFF_CASES = [c for c in CASES if min(c.m, c.k, c.n, c.g) > 0 and c.name != "many_groups"]


@pytest.mark.parametrize("case", AUTODIFF_CASES, ids=[c.name for c in AUTODIFF_CASES])
def test_grouped_matmul_passes_check_grads_forward_and_reverse_to_second_order(case):
    x = inputs(case)
    with jax_frontend.x64():
        sizes = jnp.asarray(x["group_sizes"])
        offset = None if case.group_offset is None else jnp.int64(case.group_offset)
        for transpose in (False, True):
            rhs = x["rhs"].transpose(0, 2, 1) if transpose else x["rhs"]
            f = lambda l, r, b: gj.grouped_matmul(l, r, sizes, bias=b, transpose_rhs=transpose,
                                                  group_offset=offset)
            jax.test_util.check_grads(f, tuple(jnp.asarray(a, jnp.float64) for a in (x["lhs"], rhs, x["bias"])),
                                      order=2, modes=["fwd", "rev"])


@pytest.mark.parametrize("case", [c for c in AUTODIFF_CASES if _valid_for_lax(c)],
                         ids=[c.name for c in AUTODIFF_CASES if _valid_for_lax(c)])
def test_ragged_dot_passes_check_grads_and_its_jvp_matches_jax(case):
    x = inputs(case)
    with jax_frontend.x64():
        lhs, rhs = jnp.asarray(x["lhs"], jnp.float64), jnp.asarray(x["rhs"], jnp.float64)
        sizes = jnp.asarray(x["group_sizes"])
        jax.test_util.check_grads(lambda l, r: ragged_dot(l, r, sizes), (lhs, rhs), order=2, modes=["fwd", "rev"])
        tangents = (jnp.ones_like(lhs), jnp.ones_like(rhs))
        ours = jax.jvp(lambda l, r: ragged_dot(l, r, sizes), (lhs, rhs), tangents)
        theirs = jax.jvp(lambda l, r: jax.lax.ragged_dot(l, r, sizes), (lhs, rhs), tangents)
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["middle_empty", "window_middle", "all_empty"])
def test_weight_gradient_product_passes_check_grads_with_accumulation(name):
    c = case(name)
    x = inputs(c)
    with jax_frontend.x64():
        sizes = jnp.asarray(x["group_sizes"])
        offset = None if c.group_offset is None else jnp.int64(c.group_offset)
        f = lambda l, d, acc: gj.grouped_matmul_wgrad(l, d, sizes, num_groups=c.g, group_offset=offset,
                                                      accumulate_into=acc)
        args = tuple(jnp.asarray(x[k], jnp.float64) for k in ("lhs", "dout", "acc"))
        jax.test_util.check_grads(f, args, order=2, modes=["fwd", "rev"])


def test_hessian_jacfwd_and_linear_transpose_keep_exact_zeros():
    c = case("middle_empty")  # group 1 has no rows
    x = inputs(c)
    with jax_frontend.x64():
        sizes = jnp.asarray(x["group_sizes"])
        lhs, rhs = jnp.asarray(x["lhs"][:, :3], jnp.float64), jnp.asarray(x["rhs"][:, :3, :2], jnp.float64)
        loss = lambda r: jnp.sum(gj.grouped_matmul(lhs, r, sizes) ** 2)
        hess = np.asarray(jax.hessian(loss)(rhs))  # [G, 3, 2, G, 3, 2]
        assert (hess[1] == 0).all() and (hess[:, :, :, 1] == 0).all()
        want = np.einsum("ri,rj->ij", x["lhs"][:8, :3], x["lhs"][:8, :3])  # group 0's rows
        np.testing.assert_allclose(hess[0, :, 0, 0, :, 0], 2 * want, rtol=1e-10)
        jac = np.asarray(jax.jacfwd(lambda r: gj.grouped_matmul(lhs, r, sizes))(rhs))
        assert (jac[:, :, 1] == 0).all()  # no output depends on the empty group's weight
        transpose = jax.linear_transpose(lambda l: gj.grouped_matmul(l, rhs, sizes), lhs)
        (dlhs,) = transpose(jnp.ones((c.m, 2)))
        np.testing.assert_allclose(np.asarray(dlhs), np.asarray(jax.grad(
            lambda l: gj.grouped_matmul(l, rhs, sizes).sum())(lhs)), rtol=1e-12)


def test_export_with_disabled_checks_round_trips_the_bfloat16_and_fp8_calls_bitwise():
    # export_disabled_checks names every registered target, the FP8 ones too: without one
    # of them jax.export refuses the function. The deserialized artifact gives the bits of
    # the direct call.
    from jax import export

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((10, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 128, 256)), jnp.bfloat16)  # [G, K, N], then [G, N, K]
    sizes = jnp.array([4, 0, 5], jnp.int32)

    def layer(x, w, sizes):
        h = gj.grouped_matmul(x, w, sizes)  # [M, 256]
        q, scale = gj.quantize_fp8(h, "rowwise")
        wq, wscale = gj.quantize_fp8(w.reshape(3 * 128, 256), "rowwise")  # w read as [G, N, K]
        return gj.scaled_grouped_matmul(q, wq.reshape(3, 128, 256), sizes, scale, wscale.reshape(3, 128),
                                        recipe="rowwise")

    exported = export.export(jax.jit(layer), disabled_checks=gj.export_disabled_checks())(x, w, sizes)
    restored = export.deserialize(exported.serialize())
    assert_same_bits(np.asarray(restored.call(x, w, sizes)), np.asarray(jax.jit(layer)(x, w, sizes)), "exported")
    with pytest.raises(ValueError, match="custom calls"):
        export.export(jax.jit(layer))(x, w, sizes)


def test_export_with_a_symbolic_number_of_rows_takes_group_sizes_as_a_python_list():
    # A list's sizes are clamped to the rows, which a symbolic M cannot be compared with (it
    # failed with jax's InconclusiveDimensionOperation); the artifact gives the direct call's
    # bits at several row counts, sizes past the rows included.
    from jax import export

    m = export.symbolic_shape("M")[0]
    rng = np.random.default_rng(1)
    rhs = jnp.asarray(rng.standard_normal((3, 4, 5)), jnp.float32)
    layer = jax.jit(lambda lhs, rhs: gj.grouped_matmul(lhs, rhs, [3, 0, 100]))
    exported = export.export(layer, disabled_checks=gj.export_disabled_checks())(
        jax.ShapeDtypeStruct((m, 4), jnp.float32), jax.ShapeDtypeStruct((3, 4, 5), jnp.float32))
    restored = export.deserialize(exported.serialize())
    for rows in (1, 3, 7):
        lhs = jnp.asarray(rng.standard_normal((rows, 4)), jnp.float32)
        assert_same_bits(np.asarray(restored.call(lhs, rhs)), np.asarray(layer(lhs, rhs)), f"{rows} rows")


def test_export_with_a_symbolic_number_of_experts_of_the_router_is_refused_naming_it():
    # It failed inside the argument checks with jax's InconclusiveDimensionOperation.
    from jax import export

    e = export.symbolic_shape("E")[0]
    with pytest.raises(ValueError, match=r"softmax_topk: logits has a symbolic number of experts \(E\)"):
        export.export(jax.jit(lambda logits: gj.softmax_topk(logits, 2)))(jax.ShapeDtypeStruct((4, e), jnp.float32))


FP8_OPS = "quantize_fp8_grouped / scaled_grouped_matmul / grouped_mlp(fp8=...)"


def _symbolic_workspace_calls(s):
    """(the op its error names, the function, its operands' shapes, the symbolic size named) by
    case, with s a symbolic size."""
    def expert_mlp(x, i, w_in, w_out):
        return gj.expert_mlp(x, i, None, w_in, w_out)

    return {"permute": ("permute", lambda x, i: gj.permute(x, i, 4)[0], ((s, 16), (s, 2)), 2 * s),
            "expert_mlp": ("expert_mlp", expert_mlp, ((s, 16), (s, 2), (4, 16, 48), (4, 24, 16)), 2 * s),
            # it once failed inside the shape checks, comparing E with int32's range
            "expert_mlp experts": ("expert_mlp", expert_mlp, ((8, 16), (8, 2), (s, 16, 48), (s, 24, 16)), s),
            "unpermute": ("unpermute (its gradient)", jax.grad(lambda p, i: gj.unpermute(p, i).sum()),
                          ((s, 16), (s, 1)), s),
            "fp8": (FP8_OPS, lambda x, i: gj.quantize_fp8_grouped(x, i, "rowwise")[0], ((s, 16), (3,)), s)}


@pytest.mark.parametrize("case", ["permute", "expert_mlp", "expert_mlp experts", "unpermute", "fp8"])
def test_export_with_a_symbolic_size_of_a_routing_op_is_refused_naming_it(case):
    # The core sizes these calls' CUDA workspace from T * k (and E): with CUDA built, a
    # symbolic one is named (it once failed inside the shape checks, then inside the core's
    # binding); a CPU-only build has no workspace and exports the call.
    from jax import export

    from groupgemm import _core

    op, fn, shapes, size = _symbolic_workspace_calls(export.symbolic_shape("S")[0])[case]
    args = [jax.ShapeDtypeStruct(s, jnp.int32 if i == 1 else jnp.float32) for i, s in enumerate(shapes)]
    run = lambda: export.export(jax.jit(fn), disabled_checks=gj.export_disabled_checks())(*args)  # noqa: E731
    if not _core.cuda_compiled():
        run()
        return
    with pytest.raises(ValueError, match=re.escape(f"{op}: a symbolic size ({size}) sizes this call's CUDA workspace")):
        run()


NOT_ARRAYS = {  # a call with one argument replaced by `value`, and that argument's name
    "grouped_matmul lhs": (lambda v: gj.grouped_matmul(v, jnp.ones((2, 4, 3)), jnp.asarray([1, 1])), "lhs"),
    "grouped_matmul_wgrad grad": (lambda v: gj.grouped_matmul_wgrad(jnp.ones((2, 4)), v, jnp.asarray([1, 1]),
                                                                     num_groups=2),
                                  "grad"),
    "softmax_topk logits": (lambda v: gj.softmax_topk(v, 1), "logits"),
    "permute tokens": (lambda v: gj.permute(v, jnp.zeros((2, 1), jnp.int32), 2), "tokens"),
    "unpermute permuted": (lambda v: gj.unpermute(v, jnp.zeros((2, 1), jnp.int32)), "permuted"),
    "grouped_mlp w_out": (lambda v: gj.grouped_mlp(jnp.ones((2, 4)), jnp.ones((2, 4, 6)), v, jnp.asarray([1, 1])),
                          "w_out"),
    "expert_mlp w_out": (lambda v: gj.expert_mlp(jnp.ones((2, 4)), jnp.zeros((2, 1), jnp.int32), None,
                                                 jnp.ones((2, 4, 6)), v), "w_out"),
    "quantize_fp8 x": (lambda v: gj.quantize_fp8(v, "rowwise"), "x"),
}


@pytest.mark.parametrize("case", list(NOT_ARRAYS))
@pytest.mark.parametrize("value", [None, "abc", {"a": 1}])
def test_an_argument_that_is_not_an_array_is_refused_naming_it(case, value):
    call, name = NOT_ARRAYS[case]
    with pytest.raises(TypeError, match=f"{case.split()[0]}: {name} must be an array, got {type(value).__name__}"):
        call(value)


@pytest.mark.parametrize("call, message", [
    (lambda: gj.grouped_matmul(jnp.ones((2, 4)), jnp.ones((2, 4, 3)), jnp.asarray([1, 1]), preferred_element_type=3),
     "grouped_matmul: preferred_element_type must be a dtype, got 3"),
    (lambda: gj.grouped_matmul_wgrad(jnp.ones((2, 4)), jnp.ones((2, 3)), jnp.asarray([1, 1]), num_groups=2,
                                     preferred_element_type="abc"),
     "grouped_matmul_wgrad: preferred_element_type must be a dtype, got 'abc'"),
    (lambda: gj.quantize_fp8(jnp.ones((2, 4)), "rowwise", dtype="abc"), "quantize_fp8: dtype must be a dtype"),
])
def test_a_dtype_argument_that_is_no_dtype_is_refused_naming_it(call, message):
    with pytest.raises(TypeError, match=message):
        call()
