"""groupgemm for JAX: grouped matmuls with custom VJPs, and a ragged_dot drop-in.

Every check here runs at trace time on static shapes and dtypes; group sizes stay on
the device and are never read by Python (jit with traced sizes compiles once).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm._shapes import check_rank, check_shape, groups_and_columns, weight_layout
from groupgemm.jax_ext import _ffi

_FLOATS = tuple(np.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64))
_SIXTEEN_BIT = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _check_float(x, name, fn):
    if np.dtype(x.dtype) not in _FLOATS:
        raise TypeError(f"{fn}: {name} must be float32, bfloat16, float16 or float64, got {x.dtype}")


def _index_operands(group_sizes, group_offset, num_groups, fn):
    """Validates group_sizes / group_offset and returns them as int32 (or int64) arrays."""
    group_sizes = jnp.asarray(group_sizes)
    if group_sizes.ndim != 1:
        raise ValueError(f"{fn}: group_sizes must be 1-D, got shape {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"{fn}: group_sizes must be an integer array, got {group_sizes.dtype}")
    if group_offset is None:
        if group_sizes.shape[0] != num_groups:
            raise ValueError(f"{fn}: group_sizes has {group_sizes.shape[0]} entries but there are "
                             f"{num_groups} groups; pass group_offset to select a window")
        group_offset = jnp.zeros((), jnp.int32)
    else:
        group_offset = jnp.asarray(group_offset)
        if group_offset.size != 1 or group_offset.ndim > 1:
            raise ValueError(f"{fn}: group_offset must be a scalar, got shape {group_offset.shape}")
        if not jnp.issubdtype(group_offset.dtype, jnp.integer):
            raise TypeError(f"{fn}: group_offset must be an integer, got {group_offset.dtype}")
        if group_sizes.shape[0] < num_groups:
            raise ValueError(f"{fn}: group_sizes has {group_sizes.shape[0]} entries, fewer than the "
                             f"{num_groups} local groups")
        group_offset = group_offset.reshape(())
    def as_index(x):
        return x if x.dtype == jnp.int64 else x.astype(jnp.int32)
    return as_index(group_sizes), as_index(group_offset)


def _out_dtype(in_dtype, preferred_element_type, fn):
    if preferred_element_type is None:
        return np.dtype(in_dtype)
    out = np.dtype(preferred_element_type)
    if out == np.dtype(in_dtype) or (np.dtype(in_dtype) in _SIXTEEN_BIT and out == np.float32):
        return out
    raise TypeError(f"{fn}: preferred_element_type {out} is not supported for {in_dtype} inputs "
                    f"(use the input dtype, or float32 for 16-bit inputs)")


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _grouped_matmul(lhs, rhs, group_sizes, group_offset, bias, transpose_rhs, out_dtype):
    return _ffi.matmul(lhs, rhs, group_sizes, group_offset, bias,
                       transpose_rhs=transpose_rhs, out_dtype=out_dtype)


def _grouped_matmul_fwd(lhs, rhs, group_sizes, group_offset, bias, transpose_rhs, out_dtype):
    out = _grouped_matmul(lhs, rhs, group_sizes, group_offset, bias, transpose_rhs, out_dtype)
    return out, (lhs, rhs, group_sizes, group_offset, bias)


def _grouped_matmul_bwd(transpose_rhs, out_dtype, residuals, dout):
    lhs, rhs, group_sizes, group_offset, bias = residuals
    # The core multiplies operands of one dtype: a wider dout is rounded to the input
    # dtype once, and all three gradients use that same dout (as the torch frontend does).
    dout = dout.astype(lhs.dtype)
    num_groups = rhs.shape[0]
    dlhs = _ffi.matmul(dout, rhs, group_sizes, group_offset, None,
                       transpose_rhs=not transpose_rhs, out_dtype=lhs.dtype)
    a, b = (dout, lhs) if transpose_rhs else (lhs, dout)  # rhs [G,N,K] or [G,K,N]
    drhs = _ffi.wgrad(a, b, group_sizes, group_offset, None, num_groups=num_groups, out_dtype=rhs.dtype)
    dbias = None if bias is None else _ffi.bias_grad(dout, group_sizes, group_offset,
                                                     num_groups=num_groups, out_dtype=bias.dtype)
    return dlhs, drhs, None, None, dbias


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


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
    ``lhs``, ``rhs`` and ``bias``; empty groups get exact-zero gradients.
    """
    fn = "grouped_matmul"
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    check_rank(lhs.shape, 2, "lhs", "[M, K]", fn)
    check_rank(rhs.shape, 3, "rhs", weight_layout(transpose_rhs), fn)
    _check_float(lhs, "lhs", fn)
    if rhs.dtype != lhs.dtype:
        raise TypeError(f"{fn}: rhs dtype {rhs.dtype} differs from lhs dtype {lhs.dtype}")
    num_groups, n = groups_and_columns(lhs.shape, rhs.shape, transpose_rhs, ("lhs", "rhs", "transpose_rhs"), fn)
    if bias is not None:
        bias = jnp.asarray(bias)
        check_shape(bias.shape, (num_groups, n), "bias", fn)
        if bias.dtype != lhs.dtype:
            raise TypeError(f"{fn}: bias dtype {bias.dtype} differs from lhs dtype {lhs.dtype}")
    group_sizes, group_offset = _index_operands(group_sizes, group_offset, num_groups, fn)
    out_dtype = _out_dtype(lhs.dtype, preferred_element_type, fn)
    # Inside shard_map, give every differentiable operand the varying axes of all
    # operands, so the custom VJP's cotangents (typed like the results) match them.
    axes = _ffi.varying_axes(lhs, rhs, bias, group_sizes, group_offset)
    lhs, rhs = _ffi.mark_varying(lhs, axes), _ffi.mark_varying(rhs, axes)
    bias = None if bias is None else _ffi.mark_varying(bias, axes)
    return _grouped_matmul(lhs, rhs, group_sizes, group_offset, bias, bool(transpose_rhs), out_dtype)


def grouped_matmul_wgrad(lhs, grad, group_sizes, *, num_groups, group_offset=None,
                         accumulate_into=None, preferred_element_type=None):
    """Weight gradient ``out[g] = lhs_g^T @ grad_g``: ``[num_groups, K, N]``.

    An empty group gives exact zeros. With ``accumulate_into`` (float32 ``[G, K, N]``,
    float64 for float64 inputs) returns ``accumulate_into + lhs_g^T @ grad_g``, computed
    in place when the buffer is donated; empty groups keep their bits.
    """
    fn = "grouped_matmul_wgrad"
    lhs, grad = jnp.asarray(lhs), jnp.asarray(grad)
    check_rank(lhs.shape, 2, "lhs", "[M, K]", fn)
    check_rank(grad.shape, 2, "grad", "[M, N]", fn)
    _check_float(lhs, "lhs", fn)
    if grad.dtype != lhs.dtype:
        raise TypeError(f"{fn}: grad dtype {grad.dtype} differs from lhs dtype {lhs.dtype}")
    if grad.shape[0] != lhs.shape[0]:
        raise ValueError(f"{fn}: grad has {grad.shape[0]} rows but lhs has {lhs.shape[0]}")
    if not isinstance(num_groups, (int, np.integer)) or num_groups < 0:
        raise ValueError(f"{fn}: num_groups must be a non-negative int, got {num_groups!r}")
    group_sizes, group_offset = _index_operands(group_sizes, group_offset, int(num_groups), fn)
    shape = (int(num_groups), lhs.shape[1], grad.shape[1])
    if accumulate_into is None:
        out_dtype = _out_dtype(lhs.dtype, preferred_element_type, fn)
    else:
        accumulate_into = jnp.asarray(accumulate_into)
        want = np.dtype(np.float64 if lhs.dtype == np.float64 else np.float32)
        if accumulate_into.dtype != want:
            raise TypeError(f"{fn}: accumulate_into must be {want}, got {accumulate_into.dtype}")
        check_shape(accumulate_into.shape, shape, "accumulate_into", fn)
        out_dtype = want
    return _ffi.wgrad(lhs, grad, group_sizes, group_offset, accumulate_into,
                      num_groups=int(num_groups), out_dtype=out_dtype)


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None):
    """Drop-in for ``jax.lax.ragged_dot`` (same arguments and results), backed by groupgemm.

    Unlike ``jax.lax.ragged_dot`` it does one GEMM per group instead of a masked dense
    product, and ``group_offset`` works. ``precision`` is accepted for compatibility:
    the core always accumulates in float32 (float64 for float64 inputs).
    """
    del precision
    return grouped_matmul(lhs, rhs, group_sizes, group_offset=group_offset,
                          preferred_element_type=preferred_element_type)
