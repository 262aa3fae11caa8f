"""Public PyTorch functions: argument checks, then the groupgemm custom ops."""

from typing import Optional

import torch

from groupgemm._shapes import check_rank, check_shape, groups_and_columns, weight_layout
from groupgemm.torch_ext import ops

Tensor = torch.Tensor
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _check_float(t: Tensor, name: str, fn: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{fn}: {name} must be float32, bfloat16, float16 or float64, got {t.dtype}")


def _check_device(t: Tensor, name: str, device: torch.device, fn: str) -> None:
    if t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device} but input is on {device}; move it explicitly")


def _index_operands(group_sizes, group_offset, num_groups: int, device, fn: str):
    if not isinstance(group_sizes, Tensor):
        raise TypeError(f"{fn}: group_sizes must be a 1-D integer tensor, got {type(group_sizes).__name__}")
    if group_sizes.dim() != 1:
        raise ValueError(f"{fn}: group_sizes must be 1-D, got shape {tuple(group_sizes.shape)}")
    if group_sizes.dtype.is_floating_point or group_sizes.dtype.is_complex or group_sizes.dtype == torch.bool:
        raise TypeError(f"{fn}: group_sizes must be an integer tensor, got {group_sizes.dtype}")
    _check_device(group_sizes, "group_sizes", device, fn)
    if group_offset is None:
        if group_sizes.shape[0] != num_groups:
            raise ValueError(f"{fn}: group_sizes has {group_sizes.shape[0]} entries but there are "
                             f"{num_groups} groups; pass group_offset to select a window")
    else:
        if isinstance(group_offset, int):
            group_offset = torch.tensor(group_offset, dtype=torch.int64, device=device)
        if not isinstance(group_offset, Tensor) or group_offset.numel() != 1 or group_offset.dim() > 1:
            raise ValueError(f"{fn}: group_offset must be an int or a one-element integer tensor")
        if group_offset.dtype.is_floating_point or group_offset.dtype == torch.bool:
            raise TypeError(f"{fn}: group_offset must be an integer, got {group_offset.dtype}")
        _check_device(group_offset, "group_offset", device, fn)
        if group_sizes.shape[0] < num_groups:
            raise ValueError(f"{fn}: group_sizes has {group_sizes.shape[0]} entries, fewer than the "
                             f"{num_groups} local groups")
        group_offset = group_offset.reshape(()).to(torch.int64)

    def as_index(t):  # the core reads int32 or int64; narrower integers are widened on device
        return t if t.dtype in (torch.int32, torch.int64) else t.to(torch.int32)

    return as_index(group_sizes).contiguous(), group_offset


def _out_dtype(in_dtype, out_dtype, fn: str):
    if out_dtype is None or out_dtype == in_dtype:
        return in_dtype
    if in_dtype in _SIXTEEN_BIT and out_dtype == torch.float32:
        return out_dtype
    raise TypeError(f"{fn}: out_dtype {out_dtype} is not supported for {in_dtype} inputs "
                    "(use the input dtype, or float32 for 16-bit inputs)")


def check_grouped_mm(input, weight, group_sizes, bias, transpose_weight, group_offset, out_dtype,
                     fn="grouped_mm"):
    """Validates grouped_mm's arguments; returns (group_sizes, group_offset, out_dtype)."""
    _check_float(input, "input", fn)
    _check_float(weight, "weight", fn)
    check_rank(input.shape, 2, "input", "[M, K]", fn)
    check_rank(weight.shape, 3, "weight", weight_layout(transpose_weight), fn)
    if weight.dtype != input.dtype:
        raise TypeError(f"{fn}: weight dtype {weight.dtype} differs from input dtype {input.dtype}")
    _check_device(weight, "weight", input.device, fn)
    num_groups, n = groups_and_columns(input.shape, weight.shape, transpose_weight,
                                       ("input", "weight", "transpose_weight"), fn)
    if bias is not None:
        _check_float(bias, "bias", fn)
        check_shape(bias.shape, (num_groups, n), "bias", fn)
        if bias.dtype != input.dtype:
            raise TypeError(f"{fn}: bias dtype {bias.dtype} differs from input dtype {input.dtype}")
        _check_device(bias, "bias", input.device, fn)
    group_sizes, group_offset = _index_operands(group_sizes, group_offset, num_groups, input.device, fn)
    return group_sizes, group_offset, _out_dtype(input.dtype, out_dtype, fn)


def grouped_mm(input: Tensor, weight: Tensor, group_sizes: Tensor, bias: Optional[Tensor] = None, *,
               transpose_weight: bool = False, group_offset=None, out_dtype=None) -> Tensor:
    """``out[r] = input[r] @ weight[g] (+ bias[g])`` for the rows r of each group g.

    ``weight`` is ``[G, K, N]``, or ``[G, N, K]`` with ``transpose_weight=True`` (the
    ``nn.Linear`` layout). ``group_sizes`` is a 1-D integer tensor on input's device
    (``[G_total]`` with ``group_offset``, an int or one-element tensor selecting the
    window of global groups that ``weight`` holds). Negative sizes count as 0, rows past
    ``M`` are clipped, rows owned by no local group are exactly 0. Differentiable in
    ``input``, ``weight`` and ``bias``; empty groups get exact-zero gradients.
    """
    group_sizes, group_offset, out_dtype = check_grouped_mm(
        input, weight, group_sizes, bias, transpose_weight, group_offset, out_dtype)
    return ops.grouped_mm_op(input.contiguous(), weight.contiguous(), group_sizes,
                             None if bias is None else bias.contiguous(), group_offset,
                             bool(transpose_weight), out_dtype)


def grouped_mm_wgrad(input: Tensor, grad: Tensor, group_sizes: Tensor, num_groups: int, *,
                     group_offset=None, accumulate_into: Optional[Tensor] = None) -> Tensor:
    """Weight gradient ``out[g] = input_g^T @ grad_g`` as ``[num_groups, K, N]``.

    Empty groups give exact zeros. With ``accumulate_into`` (float32, or float64 for
    float64 inputs, contiguous ``[G, K, N]``) it adds in place and returns that tensor;
    empty groups are left bit-for-bit unchanged.
    """
    fn = "grouped_mm_wgrad"
    _check_float(input, "input", fn)
    _check_float(grad, "grad", fn)
    check_rank(input.shape, 2, "input", "[M, K]", fn)
    check_rank(grad.shape, 2, "grad", "[M, N]", fn)
    if grad.dtype != input.dtype:
        raise TypeError(f"{fn}: grad dtype {grad.dtype} differs from input dtype {input.dtype}")
    if grad.shape[0] != input.shape[0]:
        raise ValueError(f"{fn}: grad has {grad.shape[0]} rows but input has {input.shape[0]}")
    _check_device(grad, "grad", input.device, fn)
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"{fn}: num_groups must be a non-negative int, got {num_groups!r}")
    group_sizes, group_offset = _index_operands(group_sizes, group_offset, num_groups, input.device, fn)
    input, grad = input.contiguous(), ops.incoming_grad(grad, grad.dtype)
    if accumulate_into is None:
        return ops.grouped_mm_wgrad_op(input, grad, group_sizes, num_groups, group_offset, input.dtype)
    want = torch.float64 if input.dtype == torch.float64 else torch.float32
    if not isinstance(accumulate_into, Tensor) or accumulate_into.dtype != want:
        raise TypeError(f"{fn}: accumulate_into must be a {want} tensor")
    shape = (num_groups, input.shape[1], grad.shape[1])
    check_shape(accumulate_into.shape, shape, "accumulate_into", fn)
    if not accumulate_into.is_contiguous():
        raise ValueError(f"{fn}: accumulate_into must be contiguous (it is updated in place)")
    _check_device(accumulate_into, "accumulate_into", input.device, fn)
    ops.grouped_mm_wgrad_accumulate_op(input, grad, group_sizes, accumulate_into, group_offset)
    return accumulate_into
