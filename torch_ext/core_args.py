"""How the ops hand tensors to the core (groupgemm._core): as DLPack capsules,
checked for what the core cannot see (layout, contiguity, the ranks an op's shape
arithmetic relies on). Shared by gemm_ops.py, expert_ops.py and fp8_ops.py, which run on
the current torch stream (device_scratch.stream)."""

import torch
from torch.utils.dlpack import to_dlpack

Tensor = torch.Tensor


def require(op: str, *tensors) -> None:
    """(tensor, rank, name) triples: the ranks an op's shape arithmetic relies on (None: any),
    and the dense, contiguous memory the core needs (it takes no strides)."""
    for t, rank, name in tensors:
        if t is None:
            continue
        if t.layout != torch.strided:
            raise TypeError(f"groupgemm::{op}: {name} must be a dense tensor (layout torch.strided), got {t.layout}")
        if rank is not None and t.dim() != rank:
            raise ValueError(f"groupgemm::{op}: {name} must be {rank}-D, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"groupgemm::{op}: {name} must be contiguous")


def require_count(op: str, num_groups: int) -> None:
    if num_groups < 0:
        raise ValueError(f"groupgemm::{op}: num_groups must be non-negative, got {num_groups}")


def incoming_grad(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """An incoming gradient for an op: it may be wider, stride-0 (``y.sum().backward()``) or
    strided, so one rounding to ``dtype``, then contiguous."""
    return grad.to(dtype).contiguous()


def capsule(t: Tensor | None):
    """A tensor as a DLPack capsule for the core (zero-copy). The legacy to_dlpack is used
    on purpose: it is several times cheaper than Tensor.__dlpack__, which would be most
    of an empty call's time (README, call overhead), and it accepts tensors that require
    grad."""
    return None if t is None else to_dlpack(t)
