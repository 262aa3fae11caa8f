"""Torch arguments in the terms of groupgemm._contract: shapes and dtype names, devices,
and the integer operands (group sizes, offsets) as the tensors the core reads."""

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from groupgemm import _contract as contract

Tensor = torch.Tensor
NAMES = contract.TORCH_NAMES


def _size_comparison_holds(holds) -> bool:
    """While torch traces (torch.compile, export), a dynamic size is an int to the traced
    code, and comparing an unbacked one would guard on data, which fails the trace: there
    torch's rule decides it only where it is known. Anything else (eager sizes, another
    frontend's in this process) is a plain answer."""
    if torch.compiler.is_compiling() or isinstance(holds, torch.SymBool):
        return statically_known_true(holds)
    return bool(holds)


contract.size_comparison_holds = _size_comparison_holds


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_and_dtype(t, name, fn):
    dense(t, name, fn)
    return tuple(t.shape), dtype_name(t.dtype)


def dense(t, name, fn):
    """t is a tensor whose values are its memory: not sparse, not an MKL-DNN tensor."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{fn}: {name} must be a dense tensor (layout torch.strided), got {t.layout}")


def same_device(t, name, device, fn):
    contract.check_device(str(t.device), str(device), name, fn)


def written_in_place(t, name, fn):
    """A tensor the core adds into holds its values in its memory: a negative or conjugate
    view (``.conj().imag``, ``torch._neg_view``) holds their negation, so adding into it would
    subtract; refused (resolve_neg() / resolve_conj() gives a tensor that holds them). Not
    asked while torch.compile traces (dynamo cannot ask it); torch's tracing of the op then
    fails on such a view by itself, with its own message."""
    if not torch.compiler.is_compiling() and (t.is_neg() or t.is_conj()):
        raise ValueError(f"{fn}: {name} is a negative or conjugate view, whose memory holds other values than "
                         "it shows; give a tensor that holds its values (resolve_neg() / resolve_conj() returns one)")


def accumulator(fn, accumulate_into, device, operands):
    """accumulate_into (an ``[G, ...]`` sum updated in place, its shape and dtype checked by
    the contract) on the operands' device, written in place, and outside autograd: refused
    where a gradient could be asked of it, rather than silently missing (torch refuses
    ``out=`` there alike). The core refuses one that shares memory with an operand."""
    name = "accumulate_into"
    same_device(accumulate_into, name, device, fn)
    written_in_place(accumulate_into, name, fn)
    if torch._C._are_functorch_transforms_active():
        raise ValueError(f"{fn}: {name} adds in place and is not supported under torch.func transforms; "
                         f"leave {name} out (the result is then differentiable)")
    # Inside a backward (a custom Function's, under create_graph=True) the operands are saved
    # tensors that may require grad, and an accumulation there (a main_grad) is a side effect
    # that no one differentiates. (torch.compile traces a forward: no graph task to ask for.)
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands) and \
            (torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1):
        raise ValueError(f"{fn}: {name} adds in place, outside autograd, so its operands must not require grad; "
                         f"detach them, or leave {name} out (the result is then differentiable)")


def index_tensor(t: Tensor, role: str = "size") -> Tensor:
    """An integer operand as the int32/int64 tensor the core reads, its value kept; one past
    int64's maximum saturates or becomes contract.past_maximum(role)."""
    conversion = contract.index_conversion(dtype_name(t.dtype))
    if conversion is None:
        return t.contiguous()
    target, saturate = conversion
    if saturate and t.dtype == torch.uint64:  # torch has no uint64 comparison: read the bits
        as_int64 = t.contiguous().view(torch.int64)
        past = contract.past_maximum(role, target)
        return torch.where(as_int64 < 0, contract.INT64_MAX if past is None else past, as_int64)
    return t.to(getattr(torch, target)).contiguous()


def index_operands(group_sizes, group_offset, num_groups: int, device, fn: str):
    """Checked group_sizes / group_offset as the core's operands (group_offset may be None)."""
    if not isinstance(group_sizes, Tensor):
        raise TypeError(f"{fn}: group_sizes must be a 1-D integer tensor, got {type(group_sizes).__name__}")
    dense(group_sizes, "group_sizes", fn)
    contract.check_group_sizes(tuple(group_sizes.shape), dtype_name(group_sizes.dtype), num_groups,
                               group_offset is not None, fn)
    same_device(group_sizes, "group_sizes", device, fn)
    if group_offset is None:
        return index_tensor(group_sizes), None
    if not isinstance(group_offset, Tensor):  # a Python or NumPy scalar
        group_offset = torch.tensor(contract.static_group_offset(group_offset, num_groups, group_sizes.shape[0],
                                                                 fn), device=device)
    dense(group_offset, "group_offset", fn)
    contract.check_group_offset_array(tuple(group_offset.shape), dtype_name(group_offset.dtype), fn)
    same_device(group_offset, "group_offset", device, fn)
    return index_tensor(group_sizes), index_tensor(group_offset.reshape(())).to(torch.int64)
