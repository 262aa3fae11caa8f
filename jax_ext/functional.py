"""groupgemm for JAX: the checked public functions.

Every check runs at trace time on static shapes and dtypes (the rules are
groupgemm._contract's); group sizes stay on the device and are never read by Python, so
jit with traced sizes compiles once.
"""

import numpy as np

from groupgemm import _contract as contract
from groupgemm.jax_ext import primitives
from groupgemm.jax_ext.arguments import (
    as_array,
    dtype_name,
    index_operands,
    requested_dtype,
    same_varying_axes,
    shape_and_dtype,
)

NAMES = contract.JAX_NAMES


def grouped_matmul(lhs, rhs, group_sizes, *, bias=None, transpose_rhs=False, group_offset=None,
                   preferred_element_type=None):
    """``out[r] = lhs[r] @ rhs[g] (+ bias[g])`` for the rows r of each group g.

    Args:
      lhs: ``[M, K]`` rows sorted by group.
      rhs: ``[G, K, N]``, or ``[G, N, K]`` with ``transpose_rhs=True``.
      group_sizes: ``[G]`` integer rows per group (``[G_total]`` with ``group_offset``).
        Negative sizes count as 0; rows past ``M`` are clipped.
      bias: optional ``[G, N]``.
      group_offset: optional integer scalar (may be traced): ``rhs`` holds global groups
        ``[group_offset, group_offset + G)``; rows of other groups are padding.
      preferred_element_type: output dtype, the input dtype (default) or float32.

    Returns ``[M, N]``; rows owned by no local group are exactly 0. Differentiable in
    ``lhs``, ``rhs`` and ``bias`` to any order, in forward and reverse mode; empty groups
    get exact-zero gradients.
    """
    fn = "grouped_matmul"
    lhs, rhs, bias = as_array(lhs, "lhs", fn), as_array(rhs, "rhs", fn), as_array(bias, "bias", fn, optional=True)
    transpose_rhs = contract.static_flag(transpose_rhs, "transpose_rhs", fn)
    num_groups, _, out_dtype = contract.matmul(
        fn, NAMES, shape_and_dtype(lhs), shape_and_dtype(rhs), transpose_rhs,
        None if bias is None else shape_and_dtype(bias),
        requested_dtype(preferred_element_type, NAMES["out_dtype"], fn))
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, lhs.shape[0], fn)
    lhs, rhs, bias = same_varying_axes((lhs, rhs, bias), (group_sizes, group_offset))
    return primitives.matmul_p.bind(lhs, rhs, group_sizes, group_offset,
                                    primitives.placeholder(lhs.dtype) if bias is None else bias,
                                    transpose_rhs=transpose_rhs, out_dtype=np.dtype(out_dtype),
                                    has_bias=bias is not None)


def grouped_matmul_wgrad(lhs, grad, group_sizes, *, num_groups, group_offset=None,
                         accumulate_into=None, preferred_element_type=None):
    """Weight gradient ``out[g] = lhs_g^T @ grad_g``: ``[num_groups, K, N]``.

    An empty group gives exact zeros. With ``accumulate_into`` (float32 ``[G, K, N]``,
    float64 for float64 inputs) returns ``accumulate_into + lhs_g^T @ grad_g``, computed
    in place when the buffer is donated; empty groups keep their bits. Differentiable
    in ``lhs``, ``grad`` and ``accumulate_into`` to any order.
    """
    fn = "grouped_matmul_wgrad"
    lhs, grad = as_array(lhs, "lhs", fn), as_array(grad, "grad", fn)
    num_groups, shape = contract.wgrad(fn, NAMES, shape_and_dtype(lhs), shape_and_dtype(grad), num_groups)
    requested = requested_dtype(preferred_element_type, NAMES["out_dtype"], fn)
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, lhs.shape[0], fn)
    if accumulate_into is None:
        out_dtype = contract.output_dtype(dtype_name(lhs.dtype), requested, fn, NAMES["out_dtype"])
    else:
        accumulate_into = as_array(accumulate_into, "accumulate_into", fn)
        out_dtype = contract.accumulator(fn, accumulate_into.shape, dtype_name(accumulate_into.dtype), shape,
                                         dtype_name(lhs.dtype), requested, NAMES["out_dtype"])
    lhs, grad, accumulate_into = same_varying_axes((lhs, grad, accumulate_into), (group_sizes, group_offset))
    return primitives.wgrad_p.bind(
        lhs, grad, group_sizes, group_offset,
        primitives.placeholder(np.dtype(out_dtype)) if accumulate_into is None else accumulate_into,
        num_groups=num_groups, out_dtype=np.dtype(out_dtype), accumulate=accumulate_into is not None)
