"""JAX and PyTorch give bitwise-identical results: one core computes both."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from cases import CASE_IDS, CASES, DTYPES, VARIANT_IDS, VARIANTS, inputs
from forward_backward import JNP, TORCH, jax_forward_backward, torch_forward_backward
import groupgemm.jax as gj
import groupgemm.torch as gt

BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def raw_bits(x):
    """The raw bits of an array from either framework, as unsigned integers."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]).numpy().view(
            BITS[x.element_size()])
    x = np.asarray(x)
    return x.view(BITS[x.dtype.itemsize])


def assert_same_bits(a, b, what):
    bits_a, bits_b = raw_bits(a), raw_bits(b)
    assert bits_a.shape == bits_b.shape, what
    assert np.array_equal(bits_a, bits_b), f"{what}: {np.count_nonzero(bits_a != bits_b)} elements differ"


def both_frameworks(case, dtype, with_bias, transpose):
    return (jax_forward_backward(case, dtype, with_bias, transpose),
            torch_forward_backward(case, dtype, with_bias, transpose))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_jax_and_torch_outputs_and_gradients_are_bitwise_identical(case, dtype, variant):
    jax_results, torch_results = both_frameworks(case, dtype, *variant)
    for name, a, b in zip(("out", "dlhs", "drhs", "dbias"), jax_results, torch_results):
        assert_same_bits(a, b, f"{case.name}/{dtype}/{name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_token_case_gives_full_shape_exact_zero_gradients_in_both(dtype):
    case = next(c for c in CASES if c.name == "all_empty")
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
    off = case.group_offset
    acc_j = gj.grouped_matmul_wgrad(jnp.asarray(x["lhs"], JNP[dtype]), jnp.asarray(x["dout"], JNP[dtype]),
                                    jnp.asarray(x["group_sizes"]), num_groups=case.g,
                                    group_offset=None if off is None else jnp.int32(off),
                                    accumulate_into=jnp.asarray(x["acc"], jnp.float32))
    acc_t = torch.tensor(x["acc"], dtype=torch.float32)
    gt.grouped_mm_wgrad(torch.tensor(x["lhs"], dtype=TORCH[dtype]), torch.tensor(x["dout"], dtype=TORCH[dtype]),
                        torch.from_numpy(x["group_sizes"]), case.g,
                        group_offset=None if off is None else torch.tensor(off), accumulate_into=acc_t)
    assert_same_bits(np.asarray(acc_j), acc_t, f"{case.name}/{dtype}/main_grad")
