"""groupgemm.jax's drop-ins against the originals: jax.lax.ragged_dot(_general) (same
signatures, exception types, values and gradients) and megablox's gmm / tgmm (run in
Pallas' interpret mode on the CPU). No torch here."""

import importlib
import inspect

import jax
import jax.numpy as jnp
import jax_frontend
import numpy as np
import pytest
import reference as ref
from cases import CASES, inputs

import groupgemm.jax as gj

RDN = jax.lax.RaggedDotDimensionNumbers


@pytest.mark.parametrize("name", ["ragged_dot", "ragged_dot_general"])
def test_signature_is_the_installed_jax_lax_one(name):
    theirs = inspect.signature(getattr(jax.lax, name)).parameters
    ours = inspect.signature(getattr(gj, name)).parameters
    assert [(p.name, p.default) for p in ours.values()] == [(p.name, p.default) for p in theirs.values()]


BAD_SHAPES = [
    ("lhs_rank", lambda f, l, r, s: f(l[None], r, s)),
    ("rhs_rank", lambda f, l, r, s: f(l, r[0], s)),
    ("contraction", lambda f, l, r, s: f(l, jnp.ones((3, 5, 5)), s)),
    ("group_count", lambda f, l, r, s: f(l, r, s[:2])),
    ("sizes_float", lambda f, l, r, s: f(l, r, s.astype(jnp.float32))),
]


@pytest.mark.parametrize("call", [c for _, c in BAD_SHAPES], ids=[n for n, _ in BAD_SHAPES])
def test_ragged_dot_raises_the_exception_type_jax_raises(call):
    args = jnp.ones((6, 4)), jnp.ones((3, 4, 5)), jnp.asarray([2, 2, 2], jnp.int32)
    with pytest.raises(TypeError):
        call(jax.lax.ragged_dot, *args)
    with pytest.raises(TypeError, match="^ragged_dot: "):  # its own name, not the grouped_matmul it calls
        call(gj.ragged_dot, *args)


@pytest.mark.parametrize("name", ["ragged_dot", "ragged_dot_general"])
def test_a_precision_jax_refuses_is_refused_and_one_it_takes_is_taken(name):
    args = jnp.ones((6, 4)), jnp.ones((3, 4, 5)), jnp.asarray([2, 2, 2], jnp.int32)
    if name == "ragged_dot_general":
        args += (RDN((([1], [1]), ([], [])), [0], [0]),)
    for bad in ("bogus", 5, ("default", "high", "highest")):
        with pytest.raises(ValueError, match="Precision argument must be one of"):
            getattr(jax.lax, name)(*args, precision=bad)
        with pytest.raises(ValueError, match="Precision argument must be one of"):
            getattr(gj, name)(*args, precision=bad)
    for good in ("highest", jax.lax.Precision.HIGH, ("default", "high")):
        assert getattr(gj, name)(*args, precision=good).shape == (6, 5)


@pytest.mark.parametrize("lhs_dtype, rhs_dtype, preferred", [
    ("float32", "bfloat16", None), ("float32", "float32", "float16"), ("bfloat16", "bfloat16", "float32"),
    ("float16", "bfloat16", None),  # jax.lax gives bfloat16, where the common dtype is float32
])
def test_ragged_dot_promotes_and_casts_like_jax(lhs_dtype, rhs_dtype, preferred):
    rng = np.random.default_rng(0)
    lhs, rhs = jnp.asarray(rng.standard_normal((6, 4)), lhs_dtype), jnp.asarray(rng.standard_normal((3, 4, 5)),
                                                                                  rhs_dtype)
    sizes = jnp.asarray([2, 0, 3], jnp.int32)
    ours = gj.ragged_dot(lhs, rhs, sizes, preferred_element_type=preferred)
    theirs = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=preferred)
    assert ours.dtype == theirs.dtype
    np.testing.assert_allclose(np.asarray(ours[:5], np.float32), np.asarray(theirs[:5], np.float32), rtol=2e-2,
                               atol=2e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_float64_output_of_16_bit_operands_is_the_float32_one_widened(dtype):
    # The core sums 16-bit products in float32 and writes float32: an output wider than that
    # is rounded from it, not from a 16-bit result.
    rng = np.random.default_rng(0)
    lhs, rhs = jnp.asarray(rng.standard_normal((6, 32)), dtype), jnp.asarray(rng.standard_normal((2, 32, 5)), dtype)
    dout, sizes = jnp.asarray(rng.standard_normal((6, 5)), dtype), jnp.asarray([2, 4], jnp.int32)
    calls = {"ragged_dot": lambda out: gj.ragged_dot(lhs, rhs, sizes, preferred_element_type=out),
             "ragged_dot_general": lambda out: gj.ragged_dot_general(lhs, rhs, sizes, MODES["non_contracting"][0],
                                                                     preferred_element_type=out),
             "ragged_dot_general contracting": lambda out: gj.ragged_dot_general(
                 lhs, dout, sizes, MODES["contracting_dim0"][0], preferred_element_type=out),
             "gmm": lambda out: gj.gmm(lhs, rhs, sizes, preferred_element_type=out),
             "tgmm": lambda out: gj.tgmm(lhs.T, dout, sizes, preferred_element_type=out)}
    with jax_frontend.x64():
        for name, call in calls.items():
            wide = call(jnp.float64)
            assert wide.dtype == jnp.float64, name
            assert np.array_equal(np.asarray(wide), np.asarray(call(jnp.float32), np.float64)), name


def test_a_bfloat16_output_of_float16_operands_is_rounded_once_from_float32():
    # Past float16's range (65504) as jax.lax gives it, not infinite.
    lhs, rhs = jnp.full((2, 4), 200.0, jnp.float16), jnp.full((1, 4, 3), 200.0, jnp.float16)
    sizes = jnp.asarray([2], jnp.int32)
    out = gj.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.bfloat16)
    want = gj.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and np.array_equal(out, want) and (np.asarray(out, np.float32) == 159744).all()


@pytest.mark.parametrize("name", ["ragged_dot", "ragged_dot_general"])
def test_operands_of_two_dtypes_take_a_group_offset_window(name):
    # The output dtype follows jax.lax's rule, which jax.lax itself cannot be asked with the
    # call's group sizes: it knows no window, and wants one size per rhs group.
    rng = np.random.default_rng(0)
    lhs, rhs = jnp.asarray(rng.standard_normal((8, 4)), jnp.bfloat16), jnp.asarray(rng.standard_normal((2, 4, 3)))
    sizes = jnp.asarray([2, 2, 2, 2], jnp.int32)  # four experts' rows, this call's two from the third
    dims = (MODES["non_contracting"][0],) if name == "ragged_dot_general" else ()
    out = getattr(gj, name)(lhs, rhs, sizes, *dims, group_offset=2)
    promoted = getattr(gj, name)(lhs.astype(rhs.dtype), rhs, sizes, *dims, group_offset=2)
    assert out.dtype == promoted.dtype == rhs.dtype and np.array_equal(out, promoted)
    assert (out[:4] == 0).all() and not (out[4:] == 0).all()


LAX_CASES = [c for c in CASES if c.group_offset is None and min(c.group_sizes, default=0) >= 0
             and sum(c.group_sizes) <= c.m and c.g > 0 and min(c.k, c.n) > 0]

# Each mode's dimension numbers, in the layouts JAX's tests and MaxText / tokamax use; the
# operands are built from a case's lhs [m, k], rhs [g, k, n] and dout [m, n].
MODES = {
    "non_contracting": (RDN((([1], [1]), ([], [])), [0], [0]), lambda x: (x["lhs"], x["rhs"])),
    "non_contracting_rhs_nk": (RDN((([1], [2]), ([], [])), [0], [0]),
                               lambda x: (x["lhs"], x["rhs"].transpose(0, 2, 1))),
    "non_contracting_lhs_km": (RDN((([0], [1]), ([], [])), [1], [0]), lambda x: (x["lhs"].T, x["rhs"])),
    "non_contracting_rhs_kgn": (RDN((([1], [0]), ([], [])), [0], [1]),
                                lambda x: (x["lhs"], x["rhs"].transpose(1, 0, 2))),
    "contracting_dim0": (RDN((([0], [0]), ([], [])), [0], []), lambda x: (x["lhs"], x["dout"])),
    "contracting_dim1": (RDN((([1], [0]), ([], [])), [1], []), lambda x: (x["lhs"].T, x["dout"])),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", LAX_CASES, ids=[c.name for c in LAX_CASES])
def test_ragged_dot_general_agrees_with_jax_forward_and_gradients(case, mode):
    dims, operands = MODES[mode]
    x = inputs(case)
    lhs, rhs = (jnp.asarray(a, jnp.float32) for a in operands(x))
    sizes = jnp.asarray(x["group_sizes"])
    ours, our_vjp = jax.vjp(lambda l, r: gj.ragged_dot_general(l, r, sizes, dims), lhs, rhs)
    theirs = jax.lax.ragged_dot_general(lhs, rhs, sizes, dims)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    ref.assert_close(np.asarray(ours, np.float64), np.asarray(theirs, np.float64), "float32", f"{mode}/out")
    cotangent = jnp.asarray(np.random.default_rng(1).standard_normal(ours.shape), jnp.float32)
    if mode.startswith("contracting"):  # jax.lax has no gradient in this mode: the float64 reference
        rows, grad, sizes_np, ct = np.asarray(operands(x)[0]), np.asarray(rhs, np.float64), x["group_sizes"], \
            np.asarray(cotangent, np.float64)
        rows = rows if mode == "contracting_dim0" else rows.T  # [ragged rows, m]
        want_dlhs = ref.grouped_matmul(grad, ct, sizes_np, transpose_rhs=True)  # d rows[r] = grad[r] @ ct[g]^T
        want = (want_dlhs if mode == "contracting_dim0" else want_dlhs.T, ref.grouped_matmul(rows, ct, sizes_np))
    else:
        want = [np.asarray(a, np.float64) for a in jax.vjp(lambda l, r: jax.lax.ragged_dot_general(
            l, r, sizes, dims), lhs, rhs)[1](cotangent)]
    for what, a, b in zip(("dlhs", "drhs"), our_vjp(cotangent), want):
        ref.assert_close(np.asarray(a, np.float64), b, "float32", f"{mode}/{what}")


def test_ragged_batch_mode_is_a_dot_general():
    rng = np.random.default_rng(2)
    lhs, rhs = jnp.asarray(rng.standard_normal((4, 3, 5)), jnp.float32), jnp.asarray(
        rng.standard_normal((4, 5, 2)), jnp.float32)
    dims = RDN((([2], [1]), ([0], [0])), [0], [])
    sizes = jnp.asarray([1, 3], jnp.int32)
    np.testing.assert_allclose(np.asarray(gj.ragged_dot_general(lhs, rhs, sizes, dims)),
                               np.asarray(jax.lax.ragged_dot_general(lhs, rhs, sizes, dims)), rtol=1e-6)


BAD_DIMENSION_NUMBERS = {  # (lhs shape, rhs shape, dimension numbers, group sizes): jax.lax raises TypeError
    "lhs contracting dimension past its rank": ((4, 4), (2, 4, 3), RDN((([2], [1]), ([], [])), [0], [0]), [1, 3]),
    "negative ragged dimension": ((4, 4), (2, 4, 3), RDN((([1], [1]), ([], [])), [-2], [0]), [1, 3]),
    "rhs group dimension contracted": ((4, 4), (2, 4, 3), RDN((([1], [1]), ([], [])), [0], [1]), [1, 3]),
    "no rhs group dimension": ((4, 4), (4, 3), RDN((([1], [0]), ([], [])), [0], []), [1, 3]),
    "float sizes in ragged batch": ((2, 4, 4), (2, 4, 3), RDN((([2], [1]), ([0], [0])), [0], []), [1.0, 1.0]),
}


@pytest.mark.parametrize("case", list(BAD_DIMENSION_NUMBERS))
def test_ragged_dot_general_raises_where_jax_raises_instead_of_wrapping_dimensions(case):
    lhs_shape, rhs_shape, dims, sizes = BAD_DIMENSION_NUMBERS[case]
    args = jnp.ones(lhs_shape), jnp.ones(rhs_shape), jnp.asarray(sizes), dims
    with pytest.raises(TypeError):
        jax.lax.ragged_dot_general(*args)
    with pytest.raises(TypeError, match="ragged_dot_general"):
        gj.ragged_dot_general(*args)


def test_other_dimension_numbers_raise_not_implemented_naming_the_mode():
    dims = RDN((([2], [2]), ([0], [1])), [1], [0])  # batch dimensions beside a ragged non-contracting one
    with pytest.raises(NotImplementedError, match="ragged non-contracting"):
        gj.ragged_dot_general(jnp.ones((2, 6, 4)), jnp.ones((3, 2, 4, 5)), jnp.asarray([2, 2, 2]), dims)


# ---- megablox's gmm / tgmm -------------------------------------------------------------


@pytest.fixture(scope="module")
def megablox():
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _operands(m=256, k=128, n=128, seed=3):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((m, k)), jnp.float32), jnp.asarray(rng.standard_normal((4, k, n)),
                                                                                 jnp.float32),
            jnp.asarray(rng.standard_normal((m, n)), jnp.float32))


@pytest.mark.parametrize("sizes, offset, transpose, existing", [
    ([100, 0, 56, 60], None, False, False),
    ([40, 60, 0, 100, 30, 26], 2, False, True),  # a window of 4 of 6 groups; other rows keep existing_out
    ([100, 0, 56, 60], None, True, False),
])
def test_gmm_agrees_with_megablox(megablox, sizes, offset, transpose, existing):
    lhs, rhs, out0 = _operands()
    rhs = rhs.transpose(0, 2, 1) if transpose else rhs
    sizes = jnp.asarray(sizes, jnp.int32)
    kwargs = dict(group_offset=None if offset is None else jnp.asarray(offset, jnp.int32),
                  existing_out=out0 if existing else None, transpose_rhs=transpose)
    theirs = megablox.gmm(lhs, rhs, sizes, interpret=True, **kwargs)
    ours = gj.gmm(lhs, rhs, sizes, tiling=(64, 64, 64), **kwargs)
    assert ours.dtype == theirs.dtype == jnp.float32
    owned = np.asarray(ref.padding_rows(np.asarray(sizes), 256, 4, offset or 0)) == 0
    rows = slice(None) if existing else owned  # without existing_out megablox leaves other rows unwritten
    np.testing.assert_allclose(np.asarray(ours)[rows], np.asarray(theirs)[rows], rtol=1e-4, atol=1e-3)
    if not existing:
        assert (np.asarray(ours)[~owned] == 0).all()


@pytest.mark.parametrize("sizes, dtype, offset, x64", [
    ([200, 0, 90], np.uint8, None, False),  # 300 rows: more than uint8 holds
    ([100, 100, -50], np.int8, None, False),
    ([40, 60, 0, 100, 30, 26], np.int64, 2**32 + 1, True),  # past int32: a window of no group
    ([40, 60, 0, 100, 30, 26], np.int64, -(2**32) + 1, True),
])
def test_gmm_keeps_existing_out_on_the_rows_no_local_group_owns_for_any_index_dtype(sizes, dtype, offset, x64):
    lhs, rhs, out0 = (jnp.asarray(a[:300, :8] if a.ndim == 2 else a[:3, :8, :8]) for a in _operands(m=300))
    with jax_frontend.x64(x64):
        group_offset = None if offset is None else jnp.asarray(offset, dtype)
        ours = np.asarray(gj.gmm(lhs, rhs, jnp.asarray(sizes, dtype), group_offset=group_offset, existing_out=out0))
    owned = ~ref.padding_rows(np.asarray(sizes, np.int64), 300, 3, offset or 0)
    want = np.where(owned[:, None], ref.grouped_matmul(np.asarray(lhs), np.asarray(rhs), np.asarray(sizes, np.int64),
                                                       group_offset=offset or 0), np.asarray(out0))
    assert (ours[~owned] == np.asarray(out0)[~owned]).all()
    ref.assert_close(ours, want, "float32")


@pytest.mark.parametrize("sizes, offset, num_actual, existing", [
    ([100, 0, 56, 100], None, None, False),
    ([40, 60, 0, 100, 30, 26], 1, 3, True),
])
def test_tgmm_agrees_with_megablox(megablox, sizes, offset, num_actual, existing):
    lhs, _, dout = _operands()
    sizes = jnp.asarray(sizes, jnp.int32)
    g = num_actual or len(sizes)
    acc = jnp.asarray(np.random.default_rng(4).standard_normal((g, 128, 128)), jnp.float32) if existing else None
    kwargs = dict(group_offset=None if offset is None else jnp.asarray(offset, jnp.int32),
                  num_actual_groups=num_actual, existing_out=acc)
    theirs = megablox.tgmm(lhs.T, dout, sizes, interpret=True, **kwargs)
    ours = gj.tgmm(lhs.T, dout, sizes, **kwargs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-4, atol=1e-3)


def test_gmm_is_differentiable_like_megablox_gmm():
    lhs, rhs, dout = (a[:20, :8] if a.ndim == 2 else a[:, :8, :8] for a in _operands())
    sizes = jnp.asarray([5, 0, 9, 4], jnp.int32)
    (dlhs, drhs) = jax.grad(lambda l, r: jnp.sum(gj.gmm(l, r, sizes) * dout), argnums=(0, 1))(lhs, rhs)
    want_dlhs = ref.grouped_matmul(dout, np.asarray(rhs), np.asarray(sizes), transpose_rhs=True)
    want_drhs = ref.grouped_matmul_wgrad(np.asarray(lhs), np.asarray(dout), np.asarray(sizes), 4)
    ref.assert_close(np.asarray(dlhs, np.float64), want_dlhs, "float32", "dlhs")
    ref.assert_close(np.asarray(drhs, np.float64), want_drhs, "float32", "drhs")
    assert (np.asarray(drhs[1]) == 0).all() and (np.asarray(dlhs[18:]) == 0).all()


@pytest.mark.parametrize("call", ["gmm", "tgmm"])
@pytest.mark.parametrize("shape, dtype", [((2, 6, 5), jnp.float32), ((6, 5), jnp.int32), ((4, 5), jnp.float32)])
def test_an_existing_out_that_is_not_the_output_is_refused(call, shape, dtype):
    # Broadcast or cast, it would silently fill rows (gmm) or every group, the empty ones too
    # (tgmm); megablox raises ValueError for a dtype other than preferred_element_type.
    lhs, rhs, sizes = jnp.ones((6, 4)), jnp.ones((3, 4, 5)), jnp.asarray([2, 0, 4], jnp.int32)
    run = {"gmm": lambda out: gj.gmm(lhs, rhs, sizes, existing_out=out),
           "tgmm": lambda out: gj.tgmm(lhs.T, jnp.ones((6, 5)), sizes, existing_out=out)}[call]
    with pytest.raises(ValueError, match=f"{call}: existing_out must have the output's shape"):
        run(jnp.zeros(shape, dtype))


@pytest.mark.parametrize("lhs_shape, rhs_shape", [((8, 4), (7, 5)), ((8,), (4, 5)), ((8, 4), (2, 4, 5))])
def test_tgmm_names_its_own_operands_when_they_do_not_share_m(lhs_shape, rhs_shape):
    with pytest.raises(ValueError, match=r"tgmm: lhs \[k, m\] and rhs \[m, n\] must share m"):
        gj.tgmm(jnp.ones(lhs_shape), jnp.ones(rhs_shape), jnp.asarray([2, 2], jnp.int32))


def test_with_a_float32_output_of_bfloat16_operands_the_gradients_are_about_1_4x_ragged_dots_off():
    # docs/semantics.md and guides/maxtext.md: ragged_dot multiplies the float32 gradient,
    # groupgemm rounds it to bfloat16 first: the error of a bfloat16 output.
    rng = np.random.default_rng(0)
    sizes = jnp.asarray([250, 0, 375, 399], jnp.int32)
    lhs, rhs = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((1024, 256), (4, 256, 256)))
    dout = jnp.asarray(rng.standard_normal((1024, 256)), jnp.float32)
    exact = (ref.grouped_matmul(dout, np.asarray(rhs, np.float64), np.asarray(sizes), transpose_rhs=True),
             ref.grouped_matmul_wgrad(np.asarray(lhs, np.float64), np.asarray(dout), np.asarray(sizes), 4))

    def error(ragged_dot):
        grads = jax.grad(lambda l, r: jnp.sum(ragged_dot(l, r, sizes, preferred_element_type=jnp.float32) * dout),
                         argnums=(0, 1))(lhs, rhs)
        return np.array([np.linalg.norm(np.asarray(g, np.float64) - e) / np.linalg.norm(e)
                         for g, e in zip(grads, exact)])

    ratio = error(gj.ragged_dot) / error(jax.lax.ragged_dot)
    assert ((1.2 < ratio) & (ratio < 1.6)).all(), ratio


def test_tgmm_names_group_sizes_that_are_not_1_d():
    with pytest.raises(ValueError, match=r"tgmm: group_sizes must be 1-D \[num_groups\], got shape \(\)"):
        gj.tgmm(jnp.ones((8, 4)), jnp.ones((4, 5)), jnp.asarray(3, jnp.int32))


@pytest.mark.parametrize("dims", [None, {"dot_dimension_numbers": None}, ((1,), (1,))])
def test_ragged_dot_general_names_dimension_numbers_that_are_not_ragged_dot_ones(dims):
    # jax.lax raises an AttributeError of its own here.
    with pytest.raises(TypeError, match="ragged_dot_general: ragged_dot_dimension_numbers must be a "
                                        "jax.lax.RaggedDotDimensionNumbers"):
        gj.ragged_dot_general(jnp.ones((4, 8)), jnp.ones((2, 8, 3)), jnp.asarray([2, 2], jnp.int32), dims)


@pytest.mark.parametrize("call, message", [
    (lambda: gj.gmm(jnp.ones((6, 4)), jnp.ones((3, 5, 5)), jnp.asarray([2, 2, 2], jnp.int32)),
     "gmm: rhs shape .* does not contract with lhs shape"),
    (lambda: gj.gmm(jnp.ones((6, 4)), jnp.ones((3, 4, 5)), jnp.asarray([2, 2], jnp.int32)),
     "gmm: group_sizes has 2 entries but there are 3 groups"),
    (lambda: gj.tgmm(jnp.ones((4, 6)), jnp.ones((6, 5), jnp.bfloat16), jnp.asarray([2, 2, 2], jnp.int32)),
     "tgmm: rhs dtype bfloat16 differs from lhs dtype float32"),
    (lambda: gj.tgmm(jnp.ones((4, 6)), jnp.ones((6, 5)), jnp.asarray([2, 4], jnp.int32), num_actual_groups=3),
     "tgmm: group_sizes has 2 entries, fewer than the 3 local groups"),
])
def test_megablox_drop_ins_raise_in_their_own_names(call, message):
    with pytest.raises(ValueError if "dtype" not in message else TypeError, match=message):
        call()
