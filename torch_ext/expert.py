"""groupgemm for PyTorch, the expert layer: the router's softmax top-k and token permute /
unpermute (rules from groupgemm._contract), then the custom ops. Indices and row maps stay on their device."""

import torch

from groupgemm import _contract as contract
from groupgemm.torch_ext import expert_ops
from groupgemm.torch_ext.arguments import index_tensor, same_device, shape_and_dtype

Tensor = torch.Tensor


def softmax_topk(logits: Tensor, k: int, *, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    """The router: each token's top-k experts and their weights, ``(probs [T, k], expert_indices [T, k] int32)``,
    exactly as ``groupgemm.jax.softmax_topk`` (the same core op: same bits; ties go to the
    lower expert, ``-inf`` logits are never chosen). Differentiable in ``logits``."""
    fn = "softmax_topk"
    k, _ = contract.softmax_topk(fn, shape_and_dtype(logits, "logits", fn), k, renormalize)
    return expert_ops.softmax_topk_op(logits.contiguous(), k, renormalize)


def permute(tokens: Tensor, expert_indices: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Groups token rows by expert: ``(permuted [T*k, H], group_sizes [E] int32, row_map [T, k] int32)``,
    exactly as ``groupgemm.jax.permute`` (the same core op: same bits). Differentiable in
    ``tokens``."""
    fn = "permute"
    *_, num_experts = contract.permute(fn, shape_and_dtype(tokens, "tokens", fn),
                                       shape_and_dtype(expert_indices, "expert_indices", fn), num_experts)
    same_device(expert_indices, "expert_indices", tokens.device, fn)
    return expert_ops.permute_op(tokens.contiguous(), index_tensor(expert_indices), num_experts)


def unpermute(permuted: Tensor, row_map: Tensor, probs: Tensor | None = None) -> Tensor:
    """``out[t] = sum over j of probs[t, j] * permuted[row_map[t, j]]`` (``[T, H]``), exactly
    as ``groupgemm.jax.unpermute`` (the same core op). Differentiable in ``permuted`` and
    ``probs``."""
    fn = "unpermute"
    contract.unpermute(fn, shape_and_dtype(permuted, "permuted", fn), shape_and_dtype(row_map, "row_map", fn),
                       None if probs is None else shape_and_dtype(probs, "probs", fn))
    for t, name in ((row_map, "row_map"), (probs, "probs")):
        if t is not None:
            same_device(t, name, permuted.device, fn)
    return expert_ops.unpermute_op(permuted.contiguous(), row_map.contiguous(),
                                   None if probs is None else probs.contiguous())


def activate(h: Tensor, activation: str) -> Tensor:
    """The expert MLP's activation of ``h [M, F_in]``, computed in the core (see
    GroupedMLP). Zero rows stay exactly zero."""
    fn = "GroupedMLP"
    kind = contract.activation_kind(activation, fn)
    return expert_ops.activation_op(h.contiguous(), kind, contract.activation_width(activation, h.shape[1], fn))
