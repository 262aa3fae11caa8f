"""groupgemm for JAX: the checked public functions.

Every check runs at trace time on static shapes and dtypes (the rules are
groupgemm._contract's); group sizes stay on the device and are never read by Python, so
jit with traced sizes compiles once.
"""

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _contract as contract
from groupgemm.jax_ext import primitives, raw

NAMES = contract.JAX_NAMES


def dtype_name(dtype):
    return np.dtype(dtype).name


def shape_and_dtype(x):
    return tuple(x.shape), dtype_name(x.dtype)


def index_array(x):
    """An integer operand as the int32/int64 array the core reads, its value kept."""
    conversion = contract.index_conversion(dtype_name(x.dtype))
    if conversion is None:
        return x
    target, saturate = conversion
    if target == "int64" and not jax.config.jax_enable_x64:
        target = "int32"  # without int64, saturate at int32's maximum instead
    if saturate:
        x = jnp.minimum(x, np.iinfo(target).max)
    return x.astype(target)


def _index_operands(group_sizes, group_offset, num_groups, num_rows, fn):
    """group_sizes / group_offset as the core's operands (group_offset 0 when absent)."""
    if isinstance(group_sizes, (list, tuple)):
        group_sizes = contract.static_group_sizes(group_sizes, num_rows, fn)
    group_sizes = jnp.asarray(group_sizes)
    contract.check_group_sizes(group_sizes.shape, dtype_name(group_sizes.dtype), num_groups,
                               group_offset is not None, fn)
    group_sizes = index_array(group_sizes)
    if group_offset is None:
        return group_sizes, jnp.zeros((), jnp.int32)
    if not isinstance(group_offset, (jax.Array, np.ndarray)):  # a Python or NumPy scalar
        group_offset = contract.static_group_offset(group_offset, num_groups, group_sizes.shape[0], fn)
    group_offset = jnp.asarray(group_offset)
    contract.check_group_offset_array(group_offset.shape, dtype_name(group_offset.dtype), fn)
    return group_sizes, index_array(group_offset.reshape(()))


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
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    bias = None if bias is None else jnp.asarray(bias)
    num_groups, _, out_dtype = contract.matmul(
        fn, NAMES, shape_and_dtype(lhs), shape_and_dtype(rhs), bool(transpose_rhs),
        None if bias is None else shape_and_dtype(bias),
        None if preferred_element_type is None else dtype_name(preferred_element_type))
    group_sizes, group_offset = _index_operands(group_sizes, group_offset, num_groups, lhs.shape[0], fn)
    lhs, rhs, bias = same_varying_axes((lhs, rhs, bias), (group_sizes, group_offset))
    return primitives.matmul_p.bind(lhs, rhs, group_sizes, group_offset,
                                    primitives.placeholder(lhs.dtype) if bias is None else bias,
                                    transpose_rhs=bool(transpose_rhs), out_dtype=np.dtype(out_dtype),
                                    has_bias=bias is not None, batched=primitives.UNBATCHED)


def same_varying_axes(operands, index_operands):
    """Inside shard_map, the float operands get the varying axes of all operands: the
    primitives type results like them, and cotangents must match their primals' types."""
    axes = raw.varying_axes(*operands, *index_operands)
    return [None if x is None else raw.mark_varying(x, axes) for x in operands]


def grouped_matmul_wgrad(lhs, grad, group_sizes, *, num_groups, group_offset=None,
                         accumulate_into=None, preferred_element_type=None):
    """Weight gradient ``out[g] = lhs_g^T @ grad_g``: ``[num_groups, K, N]``.

    An empty group gives exact zeros. With ``accumulate_into`` (float32 ``[G, K, N]``,
    float64 for float64 inputs) returns ``accumulate_into + lhs_g^T @ grad_g``, computed
    in place when the buffer is donated; empty groups keep their bits. Differentiable
    in ``lhs``, ``grad`` and ``accumulate_into`` to any order.
    """
    fn = "grouped_matmul_wgrad"
    lhs, grad = jnp.asarray(lhs), jnp.asarray(grad)
    num_groups, shape = contract.wgrad(fn, NAMES, shape_and_dtype(lhs), shape_and_dtype(grad), num_groups)
    requested = None if preferred_element_type is None else dtype_name(preferred_element_type)
    group_sizes, group_offset = _index_operands(group_sizes, group_offset, num_groups, lhs.shape[0], fn)
    if accumulate_into is None:
        out_dtype = contract.output_dtype(dtype_name(lhs.dtype), requested, fn, NAMES["out_dtype"])
    else:
        accumulate_into = jnp.asarray(accumulate_into)
        out_dtype = contract.accumulator(fn, accumulate_into.shape, dtype_name(accumulate_into.dtype), shape,
                                         dtype_name(lhs.dtype), requested, NAMES["out_dtype"])
    lhs, grad, accumulate_into = same_varying_axes((lhs, grad, accumulate_into), (group_sizes, group_offset))
    return primitives.wgrad_p.bind(
        lhs, grad, group_sizes, group_offset,
        primitives.placeholder(np.dtype(out_dtype)) if accumulate_into is None else accumulate_into,
        num_groups=num_groups, out_dtype=np.dtype(out_dtype), accumulate=accumulate_into is not None,
        batched=primitives.UNBATCHED)
