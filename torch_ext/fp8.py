"""groupgemm's FP8 for PyTorch: ``scaled_grouped_mm`` (torch.nn.functional.scaled_grouped_mm's
signature, plus ``group_sizes`` / ``group_offset``), ``quantize_fp8`` and
``quantize_fp8_grouped``; rules from groupgemm._contract, kernels in the core."""

import torch

from groupgemm import _contract as contract
from groupgemm.torch_ext import fp8_ops
from groupgemm.torch_ext import offs as offs_convention
from groupgemm.torch_ext.arguments import accumulator, dtype_name, index_operands, same_device, shape_and_dtype

Tensor = torch.Tensor
NAMES = contract.FP8_TORCH_NAMES


def _single(value, name, fn):
    """torch's scale and recipe arguments may be one-element lists."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"{fn}: {name} must be one value or a one-element list, got {len(value)} elements")
        return value[0]
    return value


def _scaling_name(value, name, fn):
    """A torch.nn.functional.ScalingType member (torch >= 2.10) or its name."""
    value = _single(value, name, fn)
    return getattr(value, "name", value)


def quantize_fp8(x: Tensor, recipe: str, *, dtype: torch.dtype = torch.float8_e4m3fn,
                 power_of_two: bool = False) -> tuple[Tensor, Tensor]:
    """``(q, scale)``: ``x`` quantized to float8 with float32 scales, as the scaled GEMMs take them.

    2-D ``x [M, K]`` (activations, ``mat_a``): ``"rowwise"`` gives ``scale [M]``,
    ``"blockwise"`` one scale per 1 x 128 tile, ``[M, ceil(K/128)]``. 3-D ``x [G, N, K]``
    (weights stored as ``mat_b.transpose(-2, -1)``): ``[G, N]``, or one per 128 x 128 block,
    ``[G, ceil(N/128), ceil(K/128)]``. ``scale = amax / max_finite(dtype)`` per block (1 for an
    all-zero block), rounded up to a power of two with ``power_of_two``; ``q = x / scale``
    rounded to nearest even and saturated. Zeros stay exact zeros.
    """
    fn = "quantize_fp8"
    _, fp8_type, scaling = contract.quantize_fp8(fn, shape_and_dtype(x, "x", fn), recipe, dtype_name(dtype))
    power_of_two = contract.static_flag(power_of_two, "power_of_two", fn)
    x = x.contiguous()
    if x.dim() == 2:
        return fp8_ops.fp8_quantize_rows_op(x, fp8_type, scaling, power_of_two)
    if recipe == "blockwise":
        return fp8_ops.fp8_quantize_blocks_op(x, fp8_type, power_of_two)
    g, n, k = x.shape
    q, scale = fp8_ops.fp8_quantize_rows_op(x.reshape(g * n, k), fp8_type, scaling, power_of_two)
    return q.reshape(g, n, k), scale.reshape(g, n)


def quantize_fp8_grouped(x: Tensor, group_sizes: Tensor, recipe: str, *, num_groups: int | None = None,
                         group_offset=None, dtype: torch.dtype = torch.float8_e4m3fn,
                         power_of_two: bool = False) -> tuple[Tensor, Tensor]:
    """``(q [C, M], scale)``: the weight-gradient operand of ``x [M, C]`` (rows sorted by group),
    transposed so the tokens are contiguous, with one scale per (group, channel) ``[G, C]``
    (``"rowwise"``) or per 128 tokens x 1 channel, ``[B, C]`` with
    ``B = (M + 127 G) // 128``, 0 for M = 0 (``"blockwise"``): each group's blocks start at its first token,
    so no block spans two groups, and are numbered group after group. Group sizes stay on
    the device. Rows owned by no local group are exact zeros in ``q``; scale rows of empty
    groups and unused blocks are 1.
    """
    fn = "quantize_fp8_grouped"
    shape_and_dtype(x, "x", fn)
    sizes_shape = tuple(group_sizes.shape) if isinstance(group_sizes, Tensor) else None
    num_groups = contract.local_group_count(num_groups, sizes_shape, group_offset is not None, fn)
    *_, fp8_type, scaling = contract.quantize_fp8_grouped(fn, shape_and_dtype(x, "x", fn), recipe, dtype_name(dtype),
                                                           num_groups)
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, x.device, fn)
    return fp8_ops.fp8_quantize_grouped_op(x.contiguous(), group_sizes, int(num_groups), fp8_type, scaling,
                                           contract.static_flag(power_of_two, "power_of_two", fn), group_offset)


def _k_major(t: Tensor, name: str, layout: str, fn: str) -> Tensor:
    """The contiguous tensor a column-major ``mat_b`` is a transposed view of."""
    stored = t.transpose(-2, -1)
    if not stored.is_contiguous():
        raise ValueError(f"{fn}: {name} must be column-major, a transposed view of a contiguous {layout} tensor "
                         "(FP8 tensor cores read both operands K-major; torch's scaled_grouped_mm requires the same)")
    return stored


def _row_major(t: Tensor, name: str, fn: str) -> Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be row-major (contiguous)")
    return t


def scaled_grouped_mm(mat_a: Tensor, mat_b: Tensor, scale_a, scale_recipe_a, scale_b, scale_recipe_b,
                      swizzle_a=None, swizzle_b=None, bias: Tensor | None = None, offs: Tensor | None = None,
                      output_dtype: torch.dtype | None = None, contraction_dim=(),
                      use_fast_accum: bool = False, *, group_sizes: Tensor | None = None, group_offset=None,
                      num_groups: int | None = None, accumulate_into: Tensor | None = None) -> Tensor:
    """torch.nn.functional.scaled_grouped_mm for float8 operands with float32 scales, on any
    group sizes, with group sizes on the device and empty groups as exact zeros.

    - 2d x 3d (forward, dgrad): ``mat_a [M, K]`` row-major, ``mat_b [G, K, N]`` column-major
      (a transposed view of a contiguous ``[G, N, K]``); rows grouped by ``offs`` (cumulative
      ends) or ``group_sizes`` (with ``group_offset``, the window of global groups mat_b
      holds); ``[M, N]``, rows owned by no group exactly 0. ``RowWise x RowWise``:
      ``scale_a [M]``, ``scale_b [G, N]``; ``BlockWise1x128 x BlockWise128x128``:
      ``scale_a [M, K/128]``, ``scale_b [G, ceil(N/128), K/128]`` (K a multiple of 128).
      ``bias [G, N]`` in ``output_dtype``.
    - 2d x 2d (weight gradient): ``mat_a [M_a, T]`` row-major, ``mat_b [T, N]`` column-major,
      the contraction over T split into groups; ``[G, M_a, N]``, an empty group exactly 0
      (or, with ``accumulate_into``, a float32 ``[G, M_a, N]``, left bit for bit). With
      ``group_offset``, ``num_groups`` says how many groups of the window the result holds.
      ``RowWise x RowWise``: ``scale_a [G * M_a]``, ``scale_b [G * N]`` (one scale per group
      and channel); ``BlockWise1x128 x BlockWise1x128``: ``scale_a [B, M_a]``,
      ``scale_b [B, N]`` per 128 tokens x 1 channel, blocks restarting at each group's first
      token (``quantize_fp8_grouped`` makes them).

    ``mat_a`` is float8_e4m3fn, or float8_e5m2 (a gradient); ``mat_b`` float8_e4m3fn.
    ``output_dtype`` bfloat16 (None, the default, as torch's bfloat16 default) or float32;
    with ``accumulate_into`` float32 or None (the buffer's dtype). Partial sums are rescaled and added in
    float32 every 128 of the contraction whatever ``use_fast_accum`` says. Not
    differentiable (see GroupedLinear(fp8=...)).
    """
    fn = "scaled_grouped_mm"
    for value, name in ((swizzle_a, "swizzle_a"), (swizzle_b, "swizzle_b")):
        swizzle = _scaling_name(value, name, fn)
        if swizzle not in (None, "NO_SWIZZLE"):
            raise ValueError(f"{fn}: {name} must be None or NO_SWIZZLE (float32 scales are not swizzled), "
                             f"got {swizzle}")
    scale_a, scale_b = _single(scale_a, "scale_a", fn), _single(scale_b, "scale_b", fn)
    recipe_a = _scaling_name(scale_recipe_a, "scale_recipe_a", fn)
    recipe_b = _scaling_name(scale_recipe_b, "scale_recipe_b", fn)
    for t, name in ((mat_a, "mat_a"), (mat_b, "mat_b"), (scale_a, "scale_a"), (scale_b, "scale_b")):
        shape_and_dtype(t, name, fn)
        if t is not mat_a:
            same_device(t, name, mat_a.device, fn)
    contract.sizes_or_ends(fn, group_sizes is not None, offs is not None)
    # K is mat_a's last dimension and mat_b's first of [K, N] (second of [G, K, N]).
    k_dims = (1, 0) if mat_b.dim() == 2 else (1, 1)
    if tuple(contraction_dim) not in ((), k_dims):
        raise ValueError(f"{fn}: contraction_dim must be () or {k_dims} (mat_a's last dimension), got "
                         f"{tuple(contraction_dim)}")
    if mat_b.dim() == 2:
        return _weight_gradient_form(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, bias, offs, output_dtype,
                                     group_sizes, group_offset, num_groups, accumulate_into, fn)
    recipe = contract.torch_fp8_recipe(fn, "2d-3d", recipe_a, recipe_b)
    if accumulate_into is not None:
        raise ValueError(f"{fn}: accumulate_into applies to the 2d x 2d (weight-gradient) form only")
    rhs = _k_major(mat_b, "mat_b", "[G, N, K]", fn) if mat_b.dim() == 3 else mat_b
    num_groups, _, out, _, _, scaling = contract.scaled_matmul(
        fn, NAMES, shape_and_dtype(_row_major(mat_a, "mat_a", fn), "mat_a", fn), shape_and_dtype(rhs, "mat_b", fn),
        shape_and_dtype(scale_a, "scale_a", fn), shape_and_dtype(scale_b, "scale_b", fn), recipe,
        None if bias is None else shape_and_dtype(bias, "bias", fn),
        None if output_dtype is None else dtype_name(output_dtype))
    if bias is not None:
        same_device(bias, "bias", mat_a.device, fn)
    ends = offs is not None
    if ends:
        group_sizes = offs_convention.checked_ends(offs, num_groups, group_offset is not None, mat_a.device, fn)
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, mat_a.device, fn)
    return fp8_ops.scaled_grouped_mm_op(mat_a, rhs, scale_a.contiguous(), scale_b.contiguous(), group_sizes, scaling,
                                        getattr(torch, out), None if bias is None else bias.contiguous(), group_offset,
                                        ends)


def _weight_gradient_form(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, bias, offs, output_dtype, group_sizes,
                          group_offset, num_groups, accumulate_into, fn):
    recipe = contract.torch_fp8_recipe(fn, "2d-2d", recipe_a, recipe_b)
    if bias is not None:
        raise ValueError(f"{fn}: bias does not apply to the 2d x 2d (weight-gradient) form")
    rhs = _k_major(mat_b, "mat_b", "[N, T]", fn)
    ends = offs is not None
    if ends:
        group_sizes = offs_convention.checked_ends(offs, None, group_offset is not None, mat_a.device, fn)
    num_groups = contract.local_group_count(num_groups, tuple(group_sizes.shape) if isinstance(group_sizes, Tensor)
                                            else None, group_offset is not None, fn, "offs" if ends else "group_sizes")
    _, shape, _, _, scaling = contract.scaled_wgrad(
        fn, NAMES, shape_and_dtype(_row_major(mat_a, "mat_a", fn), "mat_a", fn), shape_and_dtype(rhs, "mat_b", fn),
        shape_and_dtype(scale_a, "scale_a", fn), shape_and_dtype(scale_b, "scale_b", fn), recipe, num_groups)
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, mat_a.device, fn)
    scale_a, scale_b = scale_a.contiguous(), scale_b.contiguous()
    if accumulate_into is None:
        out = contract.fp8_output_dtype(None if output_dtype is None else dtype_name(output_dtype), fn,
                                        NAMES["out_dtype"])
        return fp8_ops.scaled_grouped_mm_wgrad_op(mat_a, rhs, scale_a, scale_b, group_sizes, num_groups, scaling,
                                                  getattr(torch, out), group_offset, ends)
    acc_shape, acc_dtype = shape_and_dtype(accumulate_into, "accumulate_into", fn)
    requested = None if output_dtype is None else dtype_name(output_dtype)
    contract.fp8_accumulator(fn, acc_shape, acc_dtype, shape, requested, NAMES["out_dtype"],
                             contiguous=accumulate_into.is_contiguous(),
                             requires_grad=accumulate_into.requires_grad)
    accumulator(fn, accumulate_into, mat_a.device, (mat_a, rhs, scale_a, scale_b))
    fp8_ops.scaled_grouped_mm_wgrad_accumulate_op(mat_a, rhs, scale_a, scale_b, group_sizes, scaling, accumulate_into,
                                                  group_offset, ends)
    return accumulate_into
