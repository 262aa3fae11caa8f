"""groupgemm for PyTorch, the fused expert MLP: permute, the grouped MLP and unpermute in one
op (expert_mlp_ops.py), its arguments checked first (rules from groupgemm._contract). The
routing stays on its device."""

import torch

from groupgemm import _contract as contract
from groupgemm.torch_ext import autocast, expert, expert_mlp_ops
from groupgemm.torch_ext.arguments import index_tensor, same_device, shape_and_dtype
from groupgemm.torch_ext.op_library import _derivative_may_be_asked

Tensor = torch.Tensor


def _group_offset(group_offset, num_local: int, device, fn: str) -> Tensor | None:
    """group_offset as the core's scalar operand: None (0), a one-element integer tensor, or
    a Python or NumPy integer (contract.static_window_offset)."""
    if group_offset is None:
        return None
    if not isinstance(group_offset, Tensor):
        group_offset = torch.tensor(contract.static_window_offset(group_offset, num_local, contract.INT64_MAX, fn),
                                    device=device)
    shape, dtype = shape_and_dtype(group_offset, "group_offset", fn)
    contract.check_group_offset_array(shape, dtype, fn)
    same_device(group_offset, "group_offset", device, fn)
    return index_tensor(group_offset.reshape(()), role="id_window")


def expert_mlp(tokens: Tensor, expert_indices: Tensor, probs: Tensor | None, w_in: Tensor, w_out: Tensor, *,
               activation: str = "swiglu", b_in: Tensor | None = None, b_out: Tensor | None = None, group_offset=None,
               transpose_weight: bool = False, fp8=None) -> Tensor:
    """The expert layer fused: ``out[t] = sum over j of probs[t, j] * mlp_e(tokens[t])``,
    ``e = expert_indices[t, j]``, exactly as ``groupgemm.jax.expert_mlp`` (the same core
    op: the same bits, forward and backward).

    ``w_in [E, H, F_in]`` and ``w_out [E, F, H]``, or with ``transpose_weight=True`` the
    ``nn.Linear`` layout ``[E, F_in, H]`` and ``[E, H, F]`` (GroupedMLP's ``fc1.weight`` and
    ``fc2.weight``); ``b_in [E, F_in]``, ``b_out [E, H]``. ``expert_indices [T, k]`` holds
    global ids and the weights experts ``[group_offset, group_offset + E)``; other slots add
    nothing. ``probs [T, k]`` (tokens' dtype or float32), or None for weight 1. A gradient
    keeps fc1's output per slot only (the activation is recomputed, probs' gradient comes
    from ``dout @ w_out^T``). Differentiable in tokens, probs, the weights and biases, in
    reverse and forward mode; idle experts get exact-zero gradients. ``fp8`` is not fused
    yet: use GroupedMLP(fp8=...) in the composition. Under ``torch.autocast`` it runs in the
    autocast dtype, float32 probs kept (autocast.py).
    """
    fn = "expert_mlp"
    if fp8 is not None:
        raise NotImplementedError(f"{fn}: fp8 is not fused into the expert MLP yet; run permute, "
                                  "GroupedMLP(fp8=...) and unpermute")
    tokens, w_in, w_out, b_in, b_out = autocast.operands(tokens, w_in, w_out, b_in, b_out)
    probs = autocast.routing_weights(probs, tokens)
    kind = contract.activation_kind(activation, fn)
    transpose_weight = contract.static_flag(transpose_weight, "transpose_weight", fn)
    required = lambda t, name: shape_and_dtype(t, name, fn)  # noqa: E731
    described = lambda t, name: None if t is None else required(t, name)  # noqa: E731
    contract.expert_mlp(fn, required(tokens, "tokens"), required(expert_indices, "expert_indices"),
                        described(probs, "probs"), required(w_in, "w_in"), required(w_out, "w_out"),
                        described(b_in, "b_in"), described(b_out, "b_out"), activation, transpose_weight)
    for t, name in ((expert_indices, "expert_indices"), (probs, "probs"), (w_in, "w_in"), (w_out, "w_out"),
                    (b_in, "b_in"), (b_out, "b_out")):
        if t is not None:
            same_device(t, name, tokens.device, fn)
    offset = _group_offset(group_offset, w_in.shape[0], tokens.device, fn)
    floats = [None if t is None else t.contiguous() for t in (tokens, w_in, w_out, probs, b_in, b_out)]
    tokens, w_in, w_out, probs, b_in, b_out = floats
    want_h = _derivative_may_be_asked(floats)
    ids = index_tensor(expert_indices, role="id")
    out, _ = expert_mlp_ops.expert_mlp_op(tokens, ids, w_in, w_out, probs, b_in, b_out, offset,
                                          kind, transpose_weight, want_h)
    return out


def composed_expert_mlp(tokens: Tensor, expert_indices: Tensor, probs: Tensor | None, experts, *,
                        group_offset=None) -> Tensor:
    """expert_mlp as the composition computes it with a GroupedMLP ``experts`` (permute,
    the experts on the rows, unpermute): the layers' path with ``fused=False``, under FP8
    and with main_grad accumulation."""
    fn = "expert_mlp"
    num_local = experts.fc1.num_experts
    if experts.fc1.fp8 is None:  # 16-bit layers run in autocast's dtype: permute the rows cast, as expert_mlp does
        (tokens,) = autocast.operands(tokens)
    contract.routed_tokens(fn, shape_and_dtype(tokens, "tokens", fn),
                           shape_and_dtype(expert_indices, "expert_indices", fn),
                           None if probs is None else shape_and_dtype(probs, "probs", fn))
    offset = _group_offset(group_offset, num_local, tokens.device, fn)
    local = expert_mlp_ops.window_ids(index_tensor(expert_indices, role="id"), offset, num_local)
    rows, group_sizes, row_map = expert.permute(tokens, local, num_local)
    out = experts.forward(rows, group_sizes)  # not a call of the module: its forward's own step, inside its hooks
    return expert.unpermute(out, row_map, autocast.routing_weights(probs, out))


def fused_by_default(device: torch.device) -> bool:
    """Whether the layers run the fused op when not told (``fused=None``): on the CPU, where
    it is measured faster than the composition (docs/benchmarks.md); elsewhere the
    composition until a GPU run validates the fused kernels."""
    return device.type == "cpu"
