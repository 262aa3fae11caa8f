"""JAX and PyTorch give bitwise-identical results: one core computes both."""

import jax_frontend
import numpy as np
import pytest
import torch_frontend
from bits import assert_same_bits, raw_bits
from cases import CASE_IDS, CASES, DTYPE_TABLE, DTYPES, VARIANT_IDS, VARIANTS, inputs
from cases import case as named_case


def both_frameworks(case, dtype, with_bias, transpose):
    return (jax_frontend.forward_backward(case, dtype, with_bias, transpose),
            torch_frontend.forward_backward(case, dtype, with_bias, transpose))


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_frameworks_are_handed_the_same_input_bits(dtype):
    # Parity is only meaningful on equal inputs. 10^6 float64 draws include values that
    # round differently through float32 (torch's float64 -> float16 conversion) than directly.
    values = np.random.default_rng(1).standard_normal(10**6)
    with jax_frontend.precision(dtype):
        jax_bits = raw_bits(jax_frontend.array(values, dtype))
    torch_bits = raw_bits(torch_frontend.array(values, dtype))
    want = raw_bits(values.astype(DTYPE_TABLE[dtype][0]))
    assert np.array_equal(jax_bits, want) and np.array_equal(torch_bits, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_jax_and_torch_outputs_and_gradients_are_bitwise_identical(case, dtype, variant):
    jax_results, torch_results = both_frameworks(case, dtype, *variant)
    for name, a, b in zip(("out", "dlhs", "drhs", "dbias"), jax_results, torch_results):
        if a is None and b is None:  # no bias, no gradient for it
            continue
        assert_same_bits(a, b, f"{case.name}/{dtype}/{name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_token_case_gives_full_shape_exact_zero_gradients_in_both(dtype):
    case = named_case("all_empty")
    jax_results, torch_results = both_frameworks(case, dtype, True, True)
    for results in (jax_results, torch_results):
        out, dlhs, drhs, dbias = (np.asarray(raw_bits(r)) for r in results)
        assert out.shape == (case.m, case.n) and drhs.shape == (case.g, case.n, case.k)
        assert dbias.shape == (case.g, case.n)
        for arr in (out, dlhs, drhs, dbias):
            assert (arr == 0).all()  # +0.0 everywhere: the bit pattern is all zeros


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_accumulated_main_grad_is_bitwise_identical(case, dtype):
    x = inputs(case)
    accumulated = []
    for frontend in (jax_frontend, torch_frontend):
        lhs, dout = frontend.array(x["lhs"], dtype), frontend.array(x["dout"], dtype)
        accumulated.append(frontend.accumulate(lhs, dout, frontend.array(x["group_sizes"], "int32"), case.g,
                                               frontend.array(x["acc"], "float32"), offset=case.group_offset))
    assert_same_bits(np.asarray(accumulated[0]), accumulated[1], f"{case.name}/{dtype}/main_grad")
