"""Both frontends against the float64 NumPy reference, from one set of test bodies.

Each test takes the `frontend` fixture (helpers/frontends.py) and runs once with
groupgemm.jax and once with groupgemm.torch, through the same call surface."""

import frontends
import numpy as np
import pytest
import reference as ref
from bad_inputs import BAD_INPUTS, base_arguments
from cases import CASE_IDS, CASES, DTYPES, VARIANT_IDS, VARIANTS, case, inputs, round_to
from frontends import frontend  # noqa: F401 - the fixture


def check_against_reference(case, dtype, variant, results):
    """out, dlhs, drhs and dbias (None without bias: there is nothing to check) against the
    float64 reference, padding rows and empty groups exactly zero."""
    with_bias, transpose = variant
    out, dlhs, drhs, dbias = (None if r is None else np.asarray(r, np.float64) for r in results)
    x = inputs(case)
    lhs, rhs, bias, dout = (round_to(x[k], dtype) for k in ("lhs", "rhs", "bias", "dout"))
    rhs_stored = rhs.transpose(0, 2, 1) if transpose else rhs
    sizes, off = x["group_sizes"], case.offset
    ref.assert_close(out, ref.grouped_matmul(lhs, rhs_stored, sizes, bias if with_bias else None, transpose, off),
                     dtype, "out")
    ref.assert_close(dlhs, ref.grouped_matmul(dout, rhs_stored, sizes, None, not transpose, off), dtype, "dlhs")
    want_drhs = ref.grouped_matmul_wgrad(lhs, dout, sizes, case.g, off)
    ref.assert_close(drhs, want_drhs.transpose(0, 2, 1) if transpose else want_drhs, dtype, "drhs")
    pad = ref.padding_rows(sizes, case.m, case.g, off)
    assert (out[pad] == 0).all() and (dlhs[pad] == 0).all()
    for g in ref.empty_groups(sizes, case.m, case.g, off):
        assert (drhs[g] == 0).all()
    if not with_bias:
        assert dbias is None, "a gradient for a bias that was not passed"
        return
    ref.assert_close(dbias, ref.grouped_bias_grad(dout, sizes, case.g, off), dtype, "dbias")
    for g in ref.empty_groups(sizes, case.m, case.g, off):
        assert (dbias[g] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_forward_and_gradients_match_reference(frontend, case, dtype, variant):
    check_against_reference(case, dtype, variant, [None if r is None else frontend.to_float64(r)
                                                   for r in frontend.forward_backward(case, dtype, *variant)])


@pytest.mark.parametrize("fault", ["zero_dbias", "dbias_without_bias"])
def test_the_reference_check_fails_on_a_wrong_or_made_up_bias_gradient(fault):
    c = case("middle_empty")
    x = inputs(c)
    lhs, rhs, bias, dout = (round_to(x[k], "float32") for k in ("lhs", "rhs", "bias", "dout"))
    sizes = x["group_sizes"]
    right = [ref.grouped_matmul(lhs, rhs, sizes, bias), ref.grouped_matmul(dout, rhs, sizes, None, True),
             ref.grouped_matmul_wgrad(lhs, dout, sizes, c.g), ref.grouped_bias_grad(dout, sizes, c.g)]
    check_against_reference(c, "float32", (True, False), right)
    if fault == "zero_dbias":  # what a frontend that dropped the bias gradient would give
        planted, variant = right[:3] + [np.zeros_like(right[3])], (True, False)
    else:  # zeros made up for a bias that was not passed (what the torch adapter once returned)
        right[0] = ref.grouped_matmul(lhs, rhs, sizes)
        planted, variant = right[:3] + [np.zeros_like(right[3])], (False, False)
    with pytest.raises(AssertionError):
        check_against_reference(c, "float32", variant, planted)


# Finite differences need non-empty tensors; many_groups is left out for time (cost grows with G*K*N).
GRADIENT_CASES = [c for c in CASES if min(c.m, c.k, c.n, c.g) > 0 and c.name != "many_groups"]


@pytest.mark.parametrize("case", GRADIENT_CASES, ids=[c.name for c in GRADIENT_CASES])
def test_float64_gradients_match_finite_differences(frontend, case):
    x = inputs(case)
    with frontend.precision("float64"):
        sizes = frontend.array(x["group_sizes"], "int32")
        offset = None if case.group_offset is None else case.group_offset
        frontend.check_float64_gradients(
            lambda lhs, rhs, bias: frontend.matmul(lhs, rhs, sizes, bias=bias, offset=offset),
            (x["lhs"], x["rhs"], x["bias"]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wgrad_accumulate_adds_in_place_and_keeps_empty_groups_bitwise(frontend, dtype):
    c = case("middle_empty")
    x = inputs(c)
    lhs, dout = frontend.array(x["lhs"], dtype), frontend.array(x["dout"], dtype)
    before = x["acc"].astype(np.float32)
    acc = frontend.accumulate(lhs, dout, frontend.array(x["group_sizes"], "int32"), c.g,
                              frontend.array(before, "float32"))
    after = frontend.to_float64(acc).astype(np.float32)
    assert np.array_equal(after[1].view(np.int32), before[1].view(np.int32))
    want = ref.grouped_matmul_wgrad(round_to(x["lhs"], dtype), round_to(x["dout"], dtype), x["group_sizes"], c.g,
                                    accumulate_into=before)
    ref.assert_close(after, want, "float32")
    plain = frontend.wgrad(lhs, dout, frontend.array(x["group_sizes"], "int32"), c.g)
    assert frontend.dtype_of(plain) == dtype and (frontend.to_float64(plain)[1] == 0).all()


def test_a_float32_gradient_of_16_bit_operands_is_rounded_to_them_once_as_documented(frontend):
    # semantics.md: the backward of bfloat16 operands with a float32 output is the bfloat16
    # output's backward on the gradient rounded once, bit for bit.
    c = case("skewed")
    x = inputs(c)
    operands = (x["lhs"], x["rhs"], np.asarray(x["group_sizes"]))
    wide = frontend.matmul_and_grads(*operands, x["dout"], dtype="bfloat16", out_dtype="float32")
    narrow = frontend.matmul_and_grads(*operands, round_to(x["dout"], "bfloat16"), dtype="bfloat16")
    for got, want in zip(wide[1:], narrow[1:]):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("index_dtype", ["int8", "int16", "uint8", "int32", "int64", "uint32", "uint64"])
def test_every_integer_dtype_of_group_sizes_keeps_its_value(frontend, index_dtype):
    c = case("skewed")
    x = inputs(c)
    lhs, rhs = frontend.array(x["lhs"], "float32"), frontend.array(x["rhs"], "float32")
    want = ref.grouped_matmul(round_to(x["lhs"], "float32"), round_to(x["rhs"], "float32"), x["group_sizes"])
    with frontend.precision("float64" if index_dtype.endswith("64") else "float32"):  # JAX: 64-bit ints need x64
        got = frontend.matmul(lhs, rhs, frontend.array(x["group_sizes"], index_dtype))
    ref.assert_close(frontend.to_float64(got), want, "float32", index_dtype)


@pytest.mark.parametrize("sizes, dtype", [
    ([3_000_000_000, 0, 0, 0], "uint32"),  # wrapped to int32 it would be negative: every row padding
    ([2**32 + 1, 0, 0, 0], "uint64"),  # wrapped to int32 it would be 1 row
    ([2**63 + 5, 0, 0, 0], "uint64"),  # wrapped to int64 it would be negative
])
def test_huge_unsigned_group_sizes_clip_to_the_rows_instead_of_wrapping(frontend, sizes, dtype):
    c = case("uniform")
    x = inputs(c)
    with frontend.precision("float64" if dtype == "uint64" else "float32"):
        out = frontend.matmul(frontend.array(x["lhs"], "float32"), frontend.array(x["rhs"], "float32"),
                              frontend.array(sizes, dtype))
    want = round_to(x["lhs"], "float32") @ round_to(x["rhs"], "float32")[0]  # group 0 owns every row
    ref.assert_close(frontend.to_float64(out), want, "float32", dtype)


def test_numpy_integers_are_accepted_where_python_ints_are(frontend):
    c = case("window_middle")
    x = inputs(c)
    lhs, dout = frontend.array(x["lhs"], "float32"), frontend.array(x["dout"], "float32")
    sizes = frontend.array(x["group_sizes"], "int32")
    got = frontend.wgrad(lhs, dout, sizes, np.int64(c.g), offset=np.int64(c.group_offset))
    want = ref.grouped_matmul_wgrad(round_to(x["lhs"], "float32"), round_to(x["dout"], "float32"),
                                    x["group_sizes"], c.g, c.offset)
    ref.assert_close(frontend.to_float64(got), want, "float32")


@pytest.mark.parametrize("offset", [-(2**40), 2**40, -(2**70), 2**70])
def test_python_int_group_offsets_of_any_size_select_no_group(frontend, offset):
    c = case("window_middle")
    x = inputs(c)
    out = frontend.matmul(frontend.array(x["lhs"], "float32"), frontend.array(x["rhs"], "float32"),
                          frontend.array(x["group_sizes"], "int32"), offset=offset)
    assert (frontend.to_float64(out) == 0).all()


@pytest.mark.parametrize("name, row", [(name, r) for r in BAD_INPUTS for name in r.frontends],
                         ids=[f"{name}-{r.id}" for r in BAD_INPUTS for name in r.frontends])
def test_bad_input_raises_naming_the_argument(name, row):
    frontend = frontends.load(name)
    with pytest.raises(row.error, match=row.message(frontend.NAMES)):
        row.call(frontend, base_arguments(frontend))
