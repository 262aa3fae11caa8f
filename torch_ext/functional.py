"""groupgemm for PyTorch: the checked public functions (rules from groupgemm._contract),
then the raw ops (importing this module registers their derivatives)."""


import torch

from groupgemm import _contract as contract
from groupgemm.torch_ext import derivatives, raw  # noqa: F401 - derivatives registers the ops' autograd

Tensor = torch.Tensor
NAMES = contract.TORCH_NAMES
_INT64_MAX = torch.iinfo(torch.int64).max


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_and_dtype(t, name, fn):
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return tuple(t.shape), dtype_name(t.dtype)


def same_device(t, name, device, fn):
    contract.check_device(str(t.device), str(device), name, fn)


def index_tensor(t: Tensor) -> Tensor:
    """An integer operand as the int32/int64 tensor the core reads, its value kept."""
    conversion = contract.index_conversion(dtype_name(t.dtype))
    if conversion is None:
        return t.contiguous()
    target, saturate = conversion
    if saturate and t.dtype == torch.uint64:  # torch has no uint64 comparison: read the bits
        as_int64 = t.contiguous().view(torch.int64)
        return torch.where(as_int64 < 0, _INT64_MAX, as_int64)
    return t.to(getattr(torch, target)).contiguous()


def index_operands(group_sizes, group_offset, num_groups: int, device, fn: str):
    """Checked group_sizes / group_offset as the core's operands (group_offset may be None)."""
    if not isinstance(group_sizes, Tensor):
        raise TypeError(f"{fn}: group_sizes must be a 1-D integer tensor, got {type(group_sizes).__name__}")
    contract.check_group_sizes(tuple(group_sizes.shape), dtype_name(group_sizes.dtype), num_groups,
                               group_offset is not None, fn)
    same_device(group_sizes, "group_sizes", device, fn)
    if group_offset is None:
        return index_tensor(group_sizes), None
    if not isinstance(group_offset, Tensor):  # a Python or NumPy scalar
        group_offset = torch.tensor(contract.static_group_offset(group_offset, num_groups, group_sizes.shape[0],
                                                                 fn), device=device)
    contract.check_group_offset_array(tuple(group_offset.shape), dtype_name(group_offset.dtype), fn)
    same_device(group_offset, "group_offset", device, fn)
    return index_tensor(group_sizes), index_tensor(group_offset.reshape(())).to(torch.int64)


def check_grouped_mm(input, weight, group_sizes, bias, transpose_weight, group_offset, out_dtype,
                     fn="grouped_mm"):
    """Validates grouped_mm's arguments; returns (group_sizes, group_offset, out_dtype)."""
    num_groups, _, out = contract.matmul(
        fn, NAMES, shape_and_dtype(input, NAMES["lhs"], fn), shape_and_dtype(weight, NAMES["rhs"], fn),
        bool(transpose_weight), None if bias is None else shape_and_dtype(bias, "bias", fn),
        None if out_dtype is None else dtype_name(out_dtype))
    for t, name in ((weight, NAMES["rhs"]), (bias, "bias")):
        if t is not None:
            same_device(t, name, input.device, fn)
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, input.device, fn)
    return group_sizes, group_offset, getattr(torch, out)


def grouped_mm(input: Tensor, weight: Tensor, group_sizes: Tensor, bias: Tensor | None = None, *,
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
    return raw.grouped_mm_op(input.contiguous(), weight.contiguous(), group_sizes,
                             None if bias is None else bias.contiguous(), group_offset,
                             bool(transpose_weight), out_dtype)


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.numel() > 0 and b.numel() > 0


def grouped_mm_wgrad(input: Tensor, grad: Tensor, group_sizes: Tensor, num_groups: int, *,
                     group_offset=None, accumulate_into: Tensor | None = None) -> Tensor:
    """Weight gradient ``out[g] = input_g^T @ grad_g`` as ``[num_groups, K, N]``.

    Empty groups give exact zeros. With ``accumulate_into`` (float32, or float64 for
    float64 inputs, contiguous ``[G, K, N]``) it adds in place and returns that tensor;
    empty groups are left bit-for-bit unchanged.
    """
    fn = "grouped_mm_wgrad"
    num_groups, shape = contract.wgrad(fn, NAMES, shape_and_dtype(input, NAMES["lhs"], fn),
                                       shape_and_dtype(grad, "grad", fn), num_groups)
    same_device(grad, "grad", input.device, fn)
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, input.device, fn)
    if accumulate_into is not None:
        acc_shape, acc_dtype = shape_and_dtype(accumulate_into, "accumulate_into", fn)
        aliased = next((name for t, name in ((input, NAMES["lhs"]), (grad, "grad"))
                        if _shares_memory(accumulate_into, t)), None)
        contract.accumulator(fn, acc_shape, acc_dtype, shape, dtype_name(input.dtype), None, NAMES["out_dtype"],
                             contiguous=accumulate_into.is_contiguous(),
                             requires_grad=accumulate_into.requires_grad, aliases=aliased)
        same_device(accumulate_into, "accumulate_into", input.device, fn)
    input, grad = input.contiguous(), raw.incoming_grad(grad, grad.dtype)
    if accumulate_into is None:
        return raw.grouped_mm_wgrad_op(input, grad, group_sizes, num_groups, group_offset, input.dtype)
    raw.grouped_mm_wgrad_accumulate_op(input, grad, group_sizes, accumulate_into, group_offset)
    return accumulate_into
