"""groupgemm for PyTorch: the checked public functions (rules from groupgemm._contract),
then the ops (importing this module registers their derivatives)."""


import torch

from groupgemm import _contract as contract
from groupgemm.torch_ext import autocast, core_args, derivatives, eager, gemm_ops  # noqa: F401 - derivatives registers the ops' autograd
from groupgemm.torch_ext import offs as offs_convention
from groupgemm.torch_ext.arguments import (
    NAMES,
    accumulator,
    dtype_name,
    index_operands,
    same_device,
    shape_and_dtype,
)

Tensor = torch.Tensor


def check_grouped_mm(input, weight, group_sizes, bias, transpose_weight, group_offset, out_dtype,
                     fn="grouped_mm", quantized=False):
    """Validates grouped_mm's arguments; returns (group_sizes, group_offset, out_dtype).
    ``quantized``: an FP8 product, which quantizes each operand from its own dtype, so the
    weight's need not be the input's."""
    weight_shape, weight_dtype = shape_and_dtype(weight, NAMES["rhs"], fn)
    if quantized:
        weight_dtype = dtype_name(input.dtype)
    num_groups, _, out = contract.matmul(
        fn, NAMES, shape_and_dtype(input, NAMES["lhs"], fn), (weight_shape, weight_dtype),
        contract.static_flag(transpose_weight, "transpose_weight", fn),
        None if bias is None else shape_and_dtype(bias, "bias", fn),
        None if out_dtype is None else dtype_name(out_dtype))
    for t, name in ((weight, NAMES["rhs"]), (bias, "bias")):
        if t is not None:
            same_device(t, name, input.device, fn)
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, input.device, fn)
    return group_sizes, group_offset, getattr(torch, out)


def grouped_mm(input: Tensor, weight: Tensor, group_sizes: Tensor | None = None, bias: Tensor | None = None, *,
               transpose_weight: bool = False, group_offset=None, out_dtype=None, offs: Tensor | None = None) -> Tensor:
    """``out[r] = input[r] @ weight[g] (+ bias[g])`` for the rows r of each group g.

    ``weight`` is ``[G, K, N]``, or ``[G, N, K]`` with ``transpose_weight=True`` (the
    ``nn.Linear`` layout); a transposed view of either (``w.transpose(-2, -1)``) is read in
    place, with no copy. ``group_sizes`` is a 1-D integer tensor on input's device
    (``[G_total]`` with ``group_offset``, an int or one-element tensor selecting the
    window of global groups that ``weight`` holds). Negative sizes count as 0, rows past
    ``M`` are clipped, rows owned by no local group are exactly 0. Differentiable in
    ``input``, ``weight`` and ``bias``, in reverse and forward mode (torch.func's
    transforms too); empty groups get exact-zero gradients.

    ``offs`` instead of ``group_sizes`` takes torch._grouped_mm's convention: cumulative
    group ends (int32, 1-D, on input's device), group g owning rows ``[offs[g-1], offs[g])``
    (non-decreasing offs, the only ones torch defines; any offs is read as the group sizes
    ``max(offs[g] - offs[g-1], 0)``, laid end to end, offs.py).
    With a 2-D ``weight [K, N]`` the groups split the contraction instead:
    ``out[g] = input[:, K_g] @ weight[K_g, :]``, ``[G, M, N]`` (offs.py).

    Under ``torch.autocast`` it runs in the autocast dtype, as torch.mm does (autocast.py).
    """
    input, weight, bias = autocast.operands(input, weight, bias)
    ends = offs is not None
    if ends == (group_sizes is not None):
        contract.sizes_or_ends("grouped_mm", group_sizes is not None, ends)  # raises
    if ends and isinstance(weight, Tensor) and weight.dim() == 2:
        return offs_convention.ragged_contraction(input, weight, offs, bias=bias, transpose_weight=transpose_weight,
                                                  group_offset=group_offset, out_dtype=out_dtype, fn="grouped_mm")
    sizes = offs if ends else group_sizes
    transpose = contract.static_flag(transpose_weight, "transpose_weight", "grouped_mm")
    out = eager.grouped_mm(input, weight, sizes, bias, group_offset, transpose, out_dtype, ends, _checked)
    if out is not None:
        return out
    group_sizes, group_offset, out_dtype = _checked(input, weight, sizes, bias, group_offset, transpose, out_dtype,
                                                    ends)
    weight, transpose = eager.readable_weight(weight, transpose)
    return gemm_ops.grouped_mm_op(input.contiguous(), weight, group_sizes, None if bias is None else bias.contiguous(),
                             group_offset, transpose, out_dtype, ends)


def _checked(input, weight, sizes, bias, group_offset, transpose, out_dtype, ends, fn="grouped_mm"):
    """grouped_mm's checks, with group sizes or (ends) offs: (group_sizes, group_offset, out_dtype)."""
    if ends:
        sizes = offs_convention.row_ends(input, weight, sizes, group_offset is not None, fn)
    return check_grouped_mm(input, weight, sizes, bias, transpose, group_offset, out_dtype, fn)


def grouped_mm_wgrad(input: Tensor, grad: Tensor, group_sizes: Tensor, num_groups: int, *,
                     group_offset=None, accumulate_into: Tensor | None = None) -> Tensor:
    """Weight gradient ``out[g] = input_g^T @ grad_g`` as ``[num_groups, K, N]``.

    Empty groups give exact zeros. With ``accumulate_into`` (float32, or float64 for
    float64 inputs, contiguous ``[G, K, N]``) it adds in place and returns that tensor;
    empty groups are left bit-for-bit unchanged; that sum is outside autograd, so operands
    that require grad (grad mode on, outside a backward) and torch.func transforms are
    refused. Under ``torch.autocast`` input and grad are cast to the autocast dtype
    (autocast.py); accumulate_into keeps its dtype.
    """
    fn = "grouped_mm_wgrad"
    input, grad = autocast.operands(input, grad)
    num_groups, shape = contract.wgrad(fn, NAMES, shape_and_dtype(input, NAMES["lhs"], fn),
                                       shape_and_dtype(grad, "grad", fn), num_groups)
    same_device(grad, "grad", input.device, fn)
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, input.device, fn)
    if accumulate_into is not None:
        acc_shape, acc_dtype = shape_and_dtype(accumulate_into, "accumulate_into", fn)
        contract.accumulator(fn, acc_shape, acc_dtype, shape, dtype_name(input.dtype), None, NAMES["out_dtype"],
                             contiguous=accumulate_into.is_contiguous(), requires_grad=accumulate_into.requires_grad)
        accumulator(fn, accumulate_into, input.device, (input, grad))
    input, grad = input.contiguous(), core_args.incoming_grad(grad, grad.dtype)
    if accumulate_into is None:
        return gemm_ops.grouped_mm_wgrad_op(input, grad, group_sizes, num_groups, group_offset, input.dtype)
    gemm_ops.grouped_mm_wgrad_accumulate_op(input, grad, group_sizes, accumulate_into, group_offset)
    return accumulate_into
