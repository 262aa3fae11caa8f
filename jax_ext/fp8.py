"""groupgemm's FP8 for JAX: ``scaled_grouped_matmul`` (forward / dgrad form),
``scaled_grouped_matmul_wgrad`` (weight-gradient form), ``quantize_fp8`` and
``quantize_fp8_grouped``, checked at trace time (rules from groupgemm._contract), with
the layouts and semantics of groupgemm.torch's (the same core calls: the same bits).
Group sizes stay on the device: one jit compile serves every routing."""

import jax.numpy as jnp
import numpy as np

from groupgemm import _contract as contract
from groupgemm.jax_ext import fp8_primitives as prims
from groupgemm.jax_ext.arguments import (
    as_array,
    as_arrays,
    dtype_name,
    index_operands,
    requested_dtype,
    same_varying_axes,
    shape_and_dtype,
)
from groupgemm.jax_ext.ffi_calls import placeholder

NAMES = contract.FP8_JAX_NAMES


def quantize_fp8(x, recipe, *, dtype=jnp.float8_e4m3fn, power_of_two=False):
    """``(q, scale)``: ``x`` quantized to float8 with float32 scales, as the scaled GEMMs take them.

    2-D ``x [M, K]`` (activations, ``lhs``): ``"rowwise"`` gives ``scale [M]``,
    ``"blockwise"`` one scale per 1 x 128 tile, ``[M, ceil(K/128)]``. 3-D ``x [G, N, K]``
    (weights, ``rhs``): ``[G, N]``, or one per 128 x 128 block, ``[G, ceil(N/128), ceil(K/128)]``.
    ``scale = amax / max_finite(dtype)`` per block (1 for an all-zero block), rounded up to a
    power of two with ``power_of_two``; ``q = x / scale`` rounded to nearest even and
    saturated. Zeros stay exact zeros.
    """
    fn = "quantize_fp8"
    x = as_array(x, "x", fn)
    _, fp8_type, scaling = contract.quantize_fp8(fn, shape_and_dtype(x), recipe,
                                                 requested_dtype(dtype, "dtype", fn))
    params = dict(out_type=fp8_type, power_of_two=contract.static_flag(power_of_two, "power_of_two", fn))
    if x.ndim == 3 and recipe == "blockwise":
        return tuple(prims.quantize_blocks_p.bind(x, **params))
    return tuple(prims.quantize_rows_p.bind(x, scaling=scaling, row_dims=x.ndim - 1, **params))


def quantize_fp8_grouped(x, group_sizes, recipe, *, num_groups=None, group_offset=None, dtype=jnp.float8_e4m3fn,
                         power_of_two=False):
    """``(q [C, M], scale)``: the weight-gradient operand of ``x [M, C]`` (rows sorted by group),
    transposed so the tokens are contiguous, with one scale per (group, channel) ``[G, C]``
    (``"rowwise"``) or per 128 tokens x 1 channel, ``[B, C]`` with ``B = (M + 127 G) // 128``
    (0 for M = 0; ``"blockwise"``): each group's blocks start at its first token, so no block spans two
    groups, numbered group after group. ``num_groups`` defaults to ``len(group_sizes)``
    (required with ``group_offset``). Rows owned by no local group are exact zeros in ``q``;
    scale rows of empty groups and unused blocks are 1.
    """
    fn = "quantize_fp8_grouped"
    x = as_array(x, "x", fn)
    num_groups = _local_groups(group_sizes, group_offset, num_groups, fn)
    *_, fp8_type, scaling = contract.quantize_fp8_grouped(fn, shape_and_dtype(x), recipe,
                                                          requested_dtype(dtype, "dtype", fn), num_groups)
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, x.shape[0], fn)
    (x,) = same_varying_axes((x,), (group_sizes, group_offset))
    return tuple(prims.quantize_grouped_p.bind(x, group_sizes, group_offset, num_groups=num_groups, out_type=fp8_type,
                                               scaling=scaling,
                                               power_of_two=contract.static_flag(power_of_two, "power_of_two", fn)))


def _requested(preferred_element_type, fn):
    return requested_dtype(preferred_element_type, NAMES["out_dtype"], fn)


def _local_groups(group_sizes, group_offset, num_groups, fn):
    return contract.local_group_count(num_groups, jnp.shape(group_sizes), group_offset is not None, fn)


def scaled_grouped_matmul(lhs, rhs, group_sizes, lhs_scale, rhs_scale, *, recipe, bias=None,
                          preferred_element_type=None, group_offset=None):
    """``out[r] = lhs[r] @ rhs[g]^T`` for the rows r of each group g, float8 operands scaled.

    Args:
      lhs: ``[M, K]`` float8_e4m3fn (or float8_e5m2, a gradient), rows sorted by group.
      rhs: ``[G, N, K]`` float8_e4m3fn, K-major as FP8 tensor cores read it (the nn.Linear
        layout; torch's ``mat_b`` is its transposed view).
      group_sizes, group_offset: as in grouped_matmul.
      lhs_scale, rhs_scale: float32, ``recipe="rowwise"``: ``[M]`` and ``[G, N]``;
        ``"blockwise"``: ``[M, K/128]`` and ``[G, ceil(N/128), K/128]`` (K a multiple of 128).
      bias: optional ``[G, N]`` in the output dtype.
      preferred_element_type: bfloat16 (default) or float32.

    Each 128-long block of K is summed in float32, multiplied by its two scales and added
    to a float32 accumulator (every 128 of K, whatever the recipe); rows owned by no local
    group are exactly 0. Not differentiable (see grouped_mlp(fp8=...)).
    """
    fn = "scaled_grouped_matmul"
    lhs, rhs, lhs_scale, rhs_scale = as_arrays(fn, lhs=lhs, rhs=rhs, lhs_scale=lhs_scale, rhs_scale=rhs_scale)
    bias = as_array(bias, "bias", fn, optional=True)
    num_groups, _, out, _, _, scaling = contract.scaled_matmul(
        fn, NAMES, shape_and_dtype(lhs), shape_and_dtype(rhs), shape_and_dtype(lhs_scale), shape_and_dtype(rhs_scale),
        recipe, None if bias is None else shape_and_dtype(bias), _requested(preferred_element_type, fn))
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, lhs.shape[0], fn)
    lhs, rhs, lhs_scale, rhs_scale, bias = same_varying_axes((lhs, rhs, lhs_scale, rhs_scale, bias),
                                                              (group_sizes, group_offset))
    return prims.scaled_matmul_p.bind(lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset,
                                      placeholder(out) if bias is None else bias, scaling=scaling,
                                      out_dtype=np.dtype(out), has_bias=bias is not None)


def scaled_grouped_matmul_wgrad(lhs, rhs, group_sizes, lhs_scale, rhs_scale, *, recipe, num_groups=None,
                                group_offset=None, preferred_element_type=None, accumulate_into=None):
    """The weight-gradient form: ``out[g] = lhs[:, rows_g] @ rhs[:, rows_g]^T``, ``[G, K, N]``.

    Args:
      lhs: ``[K, M]`` float8_e4m3fn (or float8_e5m2, a gradient), rhs ``[N, M]``
        float8_e4m3fn: the tokens contiguous (``quantize_fp8_grouped`` makes both), grouped
        along M by ``group_sizes`` (``group_offset``: the window; ``num_groups`` defaults to
        ``len(group_sizes)``, required with ``group_offset``).
      lhs_scale, rhs_scale: float32, ``recipe="rowwise"``: ``[G, K]`` and ``[G, N]`` (one per
        group and channel); ``"blockwise"``: ``[B, K]`` and ``[B, N]`` per 128 tokens x 1
        channel, the blocks restarting at each group's first token, ``B = (M + 127 G) // 128``
        (0 for M = 0).
      preferred_element_type: bfloat16 (default) or float32.
      accumulate_into: optional float32 ``[G, K, N]``: returns it plus the products (in place
        when donated); an empty group keeps its bits.

    An empty group gives exact zeros. Not differentiable (see grouped_mlp(fp8=...)).
    """
    fn = "scaled_grouped_matmul_wgrad"
    lhs, rhs, lhs_scale, rhs_scale = as_arrays(fn, lhs=lhs, rhs=rhs, lhs_scale=lhs_scale, rhs_scale=rhs_scale)
    num_groups = _local_groups(group_sizes, group_offset, num_groups, fn)
    num_groups, shape, _, _, scaling = contract.scaled_wgrad(
        fn, NAMES, shape_and_dtype(lhs), shape_and_dtype(rhs), shape_and_dtype(lhs_scale), shape_and_dtype(rhs_scale),
        recipe, num_groups)
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, lhs.shape[1], fn)
    if accumulate_into is None:
        out = contract.fp8_output_dtype(_requested(preferred_element_type, fn), fn, NAMES["out_dtype"])
    else:
        accumulate_into = as_array(accumulate_into, "accumulate_into", fn)
        out = contract.fp8_accumulator(fn, accumulate_into.shape, dtype_name(accumulate_into.dtype), shape,
                                       _requested(preferred_element_type, fn), NAMES["out_dtype"])
    lhs, rhs, lhs_scale, rhs_scale, accumulate_into = same_varying_axes(
        (lhs, rhs, lhs_scale, rhs_scale, accumulate_into), (group_sizes, group_offset))
    return prims.scaled_wgrad_p.bind(lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset,
                                     placeholder(out) if accumulate_into is None else accumulate_into,
                                     num_groups=num_groups, scaling=scaling, out_dtype=np.dtype(out),
                                     accumulate=accumulate_into is not None)
