"""JAX and PyTorch give bitwise-identical results: one core computes both."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from cases import CASE_IDS, CASES, DTYPES, inputs
import groupgemm.jax as gj
import groupgemm.torch as gt

JNP = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
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


def both_frameworks(case, dtype, with_bias, transpose, device="cpu"):
    """Forward and all gradients of one case in JAX and in torch, on "cpu" or "cuda"."""
    x = inputs(case)
    rhs = x["rhs"].transpose(0, 2, 1) if transpose else x["rhs"]
    sizes, off = x["group_sizes"], case.group_offset
    jax_device = jax.devices("cpu" if device == "cpu" else "gpu")[0]
    with jax.enable_x64(dtype == "float64"), jax.default_device(jax_device):
        j = lambda a: jnp.asarray(a, JNP[dtype])  # noqa: E731
        out_j, vjp = jax.vjp(lambda l, r, b: gj.grouped_matmul(
            l, r, jnp.asarray(sizes), bias=b if with_bias else None, transpose_rhs=transpose,
            group_offset=None if off is None else jnp.int32(off)), j(x["lhs"]), j(rhs), j(x["bias"]))
        grads_j = vjp(j(x["dout"]))
        jax_results = [np.asarray(a) for a in (out_j, *grads_j)]
    t = lambda a: torch.tensor(np.asarray(a), dtype=TORCH[dtype], device=device, requires_grad=True)  # noqa: E731
    lhs_t, rhs_t, bias_t = t(x["lhs"]), t(rhs), t(x["bias"])
    out_t = gt.grouped_mm(lhs_t, rhs_t, torch.from_numpy(sizes).to(device), bias_t if with_bias else None,
                          transpose_weight=transpose,
                          group_offset=None if off is None else torch.tensor(off, device=device))
    out_t.backward(t(x["dout"]).detach())
    bias_grad = bias_t.grad if with_bias else torch.zeros_like(bias_t)
    return jax_results, [out_t, lhs_t.grad, rhs_t.grad, bias_grad]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("variant", [(False, False), (True, True)], ids=["plain", "bias_transposed"])
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
