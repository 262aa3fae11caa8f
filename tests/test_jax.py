"""groupgemm.jax against the float64 NumPy reference and against jax.lax.ragged_dot."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import CASE_IDS, CASES, DTYPES, VARIANT_IDS, VARIANTS, inputs, round_to
from forward_backward import JNP, x64
from groupgemm.jax import grouped_matmul, grouped_matmul_wgrad, ragged_dot
import reference as ref



def x64_if(dtype):
    return x64(True) if dtype == "float64" else contextlib.nullcontext()


def as_np(x):
    return np.asarray(jnp.asarray(x, jnp.float32) if x.dtype != jnp.float64 else x, np.float64)


def offset_arg(case):
    return None if case.group_offset is None else jnp.int32(case.group_offset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_forward_and_gradients_match_reference(case, dtype, variant):
    with_bias, transpose = variant
    x = inputs(case)
    lhs, rhs, bias, dout = (round_to(x[k], dtype) for k in ("lhs", "rhs", "bias", "dout"))
    rhs_stored = rhs.transpose(0, 2, 1) if transpose else rhs
    sizes = x["group_sizes"]
    with x64_if(dtype):
        j = lambda a: jnp.asarray(a, JNP[dtype])  # noqa: E731

        def f(l, r, b):
            return grouped_matmul(l, r, jnp.asarray(sizes), bias=b if with_bias else None,
                                  transpose_rhs=transpose, group_offset=offset_arg(case))

        out, vjp = jax.vjp(f, j(lhs), j(rhs_stored), j(bias))
        dlhs, drhs, dbias = vjp(j(dout))
        out, dlhs, drhs, dbias = (as_np(t) for t in (out, dlhs, drhs, dbias))

    off = case.offset
    ref.assert_close(out, ref.grouped_matmul(lhs, rhs_stored, sizes, bias if with_bias else None,
                                             transpose, off), dtype, "out")
    ref.assert_close(dlhs, ref.grouped_matmul(dout, rhs_stored, sizes, None, not transpose, off),
                     dtype, "dlhs")
    want_drhs = ref.grouped_matmul_wgrad(lhs, dout, sizes, case.g, off)
    ref.assert_close(drhs, want_drhs.transpose(0, 2, 1) if transpose else want_drhs, dtype, "drhs")
    pad = ref.padding_rows(sizes, case.m, case.g, off)
    assert (out[pad] == 0).all() and (dlhs[pad] == 0).all()
    for g in ref.empty_groups(sizes, case.m, case.g, off):
        assert (drhs[g] == 0).all()
        assert (dbias[g] == 0).all()
    if with_bias:
        ref.assert_close(dbias, ref.grouped_bias_grad(dout, sizes, case.g, off), dtype, "dbias")
    else:
        assert (dbias == 0).all()


def _valid_for_lax(case):
    return case.group_offset is None and min(case.group_sizes, default=0) >= 0 and \
        sum(case.group_sizes) <= case.m and case.g > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [c for c in CASES if _valid_for_lax(c)],
                         ids=[c.name for c in CASES if _valid_for_lax(c)])
def test_ragged_dot_agrees_with_jax_lax_ragged_dot(case, dtype):
    x = inputs(case)
    lhs, rhs, dout = (jnp.asarray(x[k], JNP[dtype]) for k in ("lhs", "rhs", "dout"))
    sizes = jnp.asarray(x["group_sizes"])
    ours, our_vjp = jax.vjp(lambda l, r: ragged_dot(l, r, sizes), lhs, rhs)
    theirs, their_vjp = jax.vjp(lambda l, r: jax.lax.ragged_dot(l, r, sizes), lhs, rhs)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    for a, b in [(ours, theirs), *zip(our_vjp(dout), their_vjp(dout))]:
        ref.assert_close(as_np(a), as_np(b), dtype, case.name)


def test_ragged_dot_accepts_group_offset_where_jax_raises():
    x = inputs(CASES[13])  # window_middle
    lhs, rhs = jnp.asarray(x["lhs"], jnp.float32), jnp.asarray(x["rhs"], jnp.float32)
    with pytest.raises((NotImplementedError, TypeError)):  # which one depends on the JAX version
        jax.jit(lambda o: jax.lax.ragged_dot(lhs, rhs, jnp.asarray(x["group_sizes"]), group_offset=o))(
            jnp.array([2], jnp.int32))
    out = ragged_dot(lhs, rhs, jnp.asarray(x["group_sizes"]), group_offset=jnp.array([2], jnp.int32))
    ref.assert_close(as_np(out), ref.grouped_matmul(x["lhs"], x["rhs"], x["group_sizes"], group_offset=2),
                     "float32")


def test_jit_with_traced_group_sizes_compiles_once():
    traces = []

    @jax.jit
    def f(lhs, rhs, sizes):
        traces.append(1)
        return grouped_matmul(lhs, rhs, sizes)

    x = inputs(CASES[0])
    lhs, rhs = jnp.asarray(x["lhs"], jnp.float32), jnp.asarray(x["rhs"], jnp.float32)
    for sizes in ([6, 6, 6, 6], [24, 0, 0, 0], [0, 0, 0, 0], [1, 2, 3, 4]):
        out = f(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        ref.assert_close(as_np(out), ref.grouped_matmul(x["lhs"], x["rhs"], sizes), "float32")
    assert len(traces) == 1


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


def test_int_dtypes_of_group_sizes_are_accepted():
    x = inputs(CASES[1])
    lhs, rhs = jnp.asarray(x["lhs"], jnp.float32), jnp.asarray(x["rhs"], jnp.float32)
    want = np.asarray(grouped_matmul(lhs, rhs, jnp.asarray(x["group_sizes"], jnp.int32)))
    for dt in (jnp.int8, jnp.int16, jnp.uint8, jnp.uint32):
        np.testing.assert_array_equal(np.asarray(grouped_matmul(lhs, rhs, jnp.asarray(x["group_sizes"], dt))), want)


def test_wgrad_accumulate_updates_donated_buffer_and_keeps_empty_groups():
    x = inputs(CASES[3])  # middle_empty
    lhs, dout = jnp.asarray(x["lhs"], jnp.bfloat16), jnp.asarray(x["dout"], jnp.bfloat16)
    acc0 = np.asarray(x["acc"], np.float32)
    step = jax.jit(lambda acc: grouped_matmul_wgrad(lhs, dout, jnp.asarray(x["group_sizes"]), num_groups=4,
                                                    accumulate_into=acc), donate_argnums=0)
    acc = step(jnp.asarray(acc0))
    np.testing.assert_array_equal(np.asarray(acc)[1].view(np.int32), acc0[1].view(np.int32))
    want = ref.grouped_matmul_wgrad(round_to(x["lhs"], "bfloat16"), round_to(x["dout"], "bfloat16"),
                                    x["group_sizes"], 4, accumulate_into=acc0)
    ref.assert_close(np.asarray(acc), want, "float32")
    plain = grouped_matmul_wgrad(lhs, dout, jnp.asarray(x["group_sizes"]), num_groups=4)
    assert plain.dtype == jnp.bfloat16 and (np.asarray(plain[1], np.float32) == 0).all()


def test_expert_parallel_shard_map_with_group_offset_matches_single_device():
    from jax.sharding import Mesh, PartitionSpec as P

    devices = np.array(jax.devices()[:2])
    mesh = Mesh(devices, ("expert",))
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


@pytest.mark.parametrize("call, error, match", [
    (lambda l, r, s: grouped_matmul(l[None], r, s), ValueError, "lhs must be 2-D"),
    (lambda l, r, s: grouped_matmul(l, r[0], s), ValueError, "rhs must be 3-D"),
    (lambda l, r, s: grouped_matmul(l, r.astype(jnp.bfloat16), s), TypeError, "rhs dtype"),
    (lambda l, r, s: grouped_matmul(l.astype(jnp.int32), r, s), TypeError, "lhs must be float32"),
    (lambda l, r, s: grouped_matmul(l, r, s, transpose_rhs=True), ValueError, "does not contract"),
    (lambda l, r, s: grouped_matmul(l, r, s[:3]), ValueError, "group_sizes has 3 entries"),
    (lambda l, r, s: grouped_matmul(l, r, s.astype(jnp.float32)), TypeError, "group_sizes must be an integer"),
    (lambda l, r, s: grouped_matmul(l, r, s[:1], group_offset=0), ValueError, "fewer than the 4 local"),
    (lambda l, r, s: grouped_matmul(l, r, s, group_offset=jnp.zeros(2, jnp.int32)), ValueError, "group_offset"),
    (lambda l, r, s: grouped_matmul(l, r, s, bias=jnp.zeros((4, 3))), ValueError, "bias must have shape"),
    (lambda l, r, s: grouped_matmul(l, r, s, preferred_element_type=jnp.float16), TypeError, "preferred_element"),
    (lambda l, r, s: grouped_matmul_wgrad(l, l, s, num_groups=4, accumulate_into=jnp.zeros((4, 16, 16),
                                          jnp.bfloat16)), TypeError, "accumulate_into must be float32"),
    (lambda l, r, s: grouped_matmul_wgrad(l, l[:3], s, num_groups=4), ValueError, "grad has 3 rows"),
])
def test_bad_input_raises_at_trace_time_naming_the_argument(call, error, match):
    x = inputs(CASES[0])
    args = (jnp.asarray(x["lhs"], jnp.float32), jnp.asarray(x["rhs"], jnp.float32), jnp.asarray(x["group_sizes"]))
    with pytest.raises(error, match=match):
        jax.jit(call)(*args)
