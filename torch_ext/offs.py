"""torch._grouped_mm's ``offs=`` convention, for grouped_mm (torchtitan calls
``torch._grouped_mm(A, B, offs=offs)``): ``offs`` holds the cumulative ends of the groups
along the ragged dimension, group g owning ``[offs[g-1], offs[g])`` (with ``offs[-1]`` read
as 0 for g = 0) where offs does not decrease, the only offs torch._grouped_mm defines.

- 2d x 3d, ``A [M, K] @ B [G, K, N] -> [M, N]``: the rows are ragged, a grouped_mm with
  group sizes ``diff(offs)``; rows past ``offs[-1]`` are exact zeros.
- 2d x 2d, ``A [M, K] @ B [K, N] -> [G, M, N]``: the contraction is ragged,
  ``out[g] = A[:, K_g] @ B[K_g, :] = (A^T)_g^T @ B_g``, the weight-gradient product of
  ``A^T`` and ``B``; the contraction past ``offs[-1]`` adds nothing and its gradients are
  exact zeros.

The core reads offs itself, as cumulative ends (size g = offs[g] - offs[g-1]), on its
device, with no host read and no extra op. Any offs is read that way: a decrease (or a
negative first end) gives a negative size, which counts as 0 like any negative group size,
and the groups' rows are then laid end to end from those sizes. So with a decreasing offs
a group starts where the one before it ended, not at ``offs[g-1]``, and the rows past
``offs[-1]`` may belong to a group.
"""

import torch

from groupgemm import _contract as contract
from groupgemm.torch_ext import gemm_ops
from groupgemm.torch_ext.arguments import NAMES, dtype_name, index_tensor, same_device, shape_and_dtype

Tensor = torch.Tensor


def checked_ends(offs, num_groups, has_offset: bool, device, fn: str) -> Tensor:
    """Checked cumulative ends as the core reads them (int32 or int64), on offs's device."""
    if not isinstance(offs, Tensor):
        raise TypeError(f"{fn}: offs must be a 1-D integer tensor, got {type(offs).__name__}")
    contract.group_ends(fn, tuple(offs.shape), dtype_name(offs.dtype), num_groups, has_offset)
    same_device(offs, "offs", device, fn)
    return index_tensor(offs)


def row_ends(input: Tensor, weight, offs, has_offset: bool, fn: str) -> Tensor:
    """The 2d x 3d form: the checked ends of the row groups, one per expert of ``weight``."""
    shape_and_dtype(input, NAMES["lhs"], fn)  # a tensor, whose device offs must share
    num_groups = weight.shape[0] if isinstance(weight, Tensor) and weight.dim() == 3 else None
    return checked_ends(offs, num_groups, has_offset, input.device, fn)


def ragged_contraction(input: Tensor, weight: Tensor, offs, *, bias, transpose_weight, group_offset, out_dtype,
                       fn: str) -> Tensor:
    """The 2d x 2d form: ``[G, M, N]`` with ``out[g] = input[:, K_g] @ weight[K_g, :]``."""
    out = contract.ragged_contraction(
        fn, NAMES, shape_and_dtype(input, NAMES["lhs"], fn), shape_and_dtype(weight, NAMES["rhs"], fn),
        None if out_dtype is None else dtype_name(out_dtype), bias=bias is not None,
        transpose=contract.static_flag(transpose_weight, "transpose_weight", fn), has_offset=group_offset is not None)
    same_device(weight, NAMES["rhs"], input.device, fn)
    ends = checked_ends(offs, None, False, input.device, fn)
    return gemm_ops.grouped_mm_wgrad_op(input.t().contiguous(), weight.contiguous(), ends, ends.shape[0], None,
                                   getattr(torch, out), True)
