"""The expert layer's ops for PyTorch: custom ops (namespace ``groupgemm``) for
token permute / unpermute, the activation and the router's softmax top-k (with its
forward-mode derivative), and their autograd.

Like gemm_ops.py's ops, each allocates its outputs with torch and hands every tensor to the
core zero-copy; derivatives, reverse and forward mode, are built from the same ops and
never read indices on the host. The public functions check every argument first
(expert.py).
"""

import torch

from groupgemm import _contract as contract
from groupgemm import _core
from groupgemm.torch_ext import device_scratch
from groupgemm.torch_ext.core_args import capsule, incoming_grad, require
from groupgemm.torch_ext.op_library import allocator, define

Tensor = torch.Tensor


def _scratch(device: torch.device, nbytes, *args) -> Tensor | None:
    """A CUDA call's own scratch, ``nbytes(Device.cuda, *args)`` bytes; None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.empty(nbytes(_core.Device.cuda, *args), dtype=torch.uint8, device=device)


def _permute_outputs(tokens, expert_indices, num_experts, empty):
    require("permute", (tokens, 2, "tokens"), (expert_indices, 2, "expert_indices"))
    contract.check_num_experts(num_experts, "groupgemm::permute")
    t, k = expert_indices.shape
    return (empty((t * k, tokens.shape[1]), tokens.dtype), empty((num_experts,), torch.int32),
            empty((t, k), torch.int32))


@define("permute", _permute_outputs)
def permute_op(tokens: Tensor, expert_indices: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    permuted, group_sizes, row_map = _permute_outputs(tokens, expert_indices, num_experts, allocator(tokens.device))
    _core.permute(*map(capsule, (tokens, expert_indices, permuted, group_sizes, row_map)),
                  capsule(_scratch(tokens.device, _core.permute_workspace_bytes, permuted.shape[0], num_experts)),
                  stream=device_scratch.stream(tokens.device))
    return permuted, group_sizes, row_map


def _unpermute_checks(op, permuted, row_map, probs):
    require(op, (permuted, 2, "permuted"), (row_map, 2, "row_map"), (probs, 2, "probs"))


def _unpermute_outputs(permuted, row_map, probs, empty):
    _unpermute_checks("unpermute", permuted, row_map, probs)
    return empty((row_map.shape[0], permuted.shape[1]), permuted.dtype)


@define("unpermute", _unpermute_outputs)
def unpermute_op(permuted: Tensor, row_map: Tensor, probs: Tensor | None = None) -> Tensor:
    out = _unpermute_outputs(permuted, row_map, probs, allocator(permuted.device))
    _core.unpermute(*map(capsule, (permuted, row_map, probs, out)), stream=device_scratch.stream(permuted.device))
    return out


def _unpermute_backward_outputs(permuted, row_map, probs, empty):
    _unpermute_checks("unpermute_backward", permuted, row_map, probs)
    dprobs = empty((0,), permuted.dtype) if probs is None else empty(probs.shape, probs.dtype)
    return empty(permuted.shape, permuted.dtype), dprobs


@define("unpermute_backward", _unpermute_backward_outputs)
def unpermute_backward_op(dout: Tensor, permuted: Tensor, row_map: Tensor,
                          probs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(dpermuted, dprobs); dprobs has no elements without probs. A row of dpermuted sums
    every slot that names it, in slot order."""
    dpermuted, dprobs = _unpermute_backward_outputs(permuted, row_map, probs, allocator(permuted.device))
    workspace = _scratch(permuted.device, _core.unpermute_backward_workspace_bytes, row_map.numel())
    _core.unpermute_backward(*map(capsule, (dout, permuted, row_map, probs, dpermuted)),
                             None if probs is None else capsule(dprobs), capsule(workspace),
                             stream=device_scratch.stream(permuted.device))
    return dpermuted, dprobs


def _activation_outputs(h, width, empty):
    require("activation", (h, 2, "h"))
    return empty((h.shape[0], width), h.dtype)


@define("activation", _activation_outputs)
def activation_op(h: Tensor, kind: int, width: int) -> Tensor:
    out = _activation_outputs(h, width, allocator(h.device))
    _core.activation(capsule(h), capsule(out), kind=kind, stream=device_scratch.stream(h.device))
    return out


def _activation_backward_outputs(dout, h, empty):
    require("activation_backward", (dout, 2, "dout"), (h, 2, "h"))
    return empty(h.shape, h.dtype)


@define("activation_backward", _activation_backward_outputs)
def activation_backward_op(dout: Tensor, h: Tensor, kind: int) -> Tensor:
    dh = _activation_backward_outputs(dout, h, allocator(h.device))
    _core.activation_backward(*map(capsule, (dout, h, dh)), kind=kind, stream=device_scratch.stream(h.device))
    return dh


def _router_probs_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _softmax_topk_outputs(logits, k, empty):
    require("softmax_topk", (logits, 2, "logits"))
    if not 0 <= k <= logits.shape[1]:
        raise ValueError(f"groupgemm::softmax_topk: k must be in [0, {logits.shape[1]}], got {k}")
    shape = (logits.shape[0], k)
    return empty(shape, _router_probs_dtype(logits)), empty(shape, torch.int32)


@define("softmax_topk", _softmax_topk_outputs)
def softmax_topk_op(logits: Tensor, k: int, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    """(probs, expert_indices)."""
    probs, indices = _softmax_topk_outputs(logits, k, allocator(logits.device))
    _core.softmax_topk(*map(capsule, (logits, indices, probs)), renormalize=renormalize,
                       stream=device_scratch.stream(logits.device))
    return probs, indices


def _softmax_topk_backward_outputs(logits, expert_indices, dprobs, empty):
    require("softmax_topk_backward", (logits, 2, "logits"), (expert_indices, 2, "expert_indices"),
             (dprobs, 2, "dprobs"))
    return empty(logits.shape, logits.dtype)


@define("softmax_topk_backward", _softmax_topk_backward_outputs)
def softmax_topk_backward_op(logits: Tensor, expert_indices: Tensor, dprobs: Tensor,
                             renormalize: bool = True) -> Tensor:
    dlogits = _softmax_topk_backward_outputs(logits, expert_indices, dprobs, allocator(logits.device))
    _core.softmax_topk_backward(*map(capsule, (logits, expert_indices, dprobs, dlogits)), renormalize=renormalize,
                                stream=device_scratch.stream(logits.device))
    return dlogits


def _softmax_topk_tangent_outputs(logits, expert_indices, empty):
    require("softmax_topk_tangent", (logits, 2, "logits"), (expert_indices, 2, "expert_indices"))
    return empty(expert_indices.shape, _router_probs_dtype(logits))


@define("softmax_topk_tangent", _softmax_topk_tangent_outputs)
def softmax_topk_tangent_op(logits: Tensor, expert_indices: Tensor, tlogits: Tensor,
                            renormalize: bool = True) -> Tensor:
    """The tangent of softmax_topk's probs for the logits' tangent (forward mode)."""
    tprobs = _softmax_topk_tangent_outputs(logits, expert_indices, allocator(logits.device))
    _core.softmax_topk_tangent(*map(capsule, (logits, expert_indices, tlogits, tprobs)), renormalize=renormalize,
                               stream=device_scratch.stream(logits.device))
    return tprobs


# ---- derivatives: each is another op ------------------------------------------------
# permute and unpermute are linear in tokens, permuted and probs, so their tangents are the
# same ops applied to the tangents. The activation's tangent is J @ t; its backward gives
# J^T @ dout, and J is diagonal for the elementwise activations. For swiglu
# (out = silu(gate) * up) the backward of dout = t_gate gives t_gate * up * silu'(gate) in its
# gate half, and of dout = t_up gives t_up * silu(gate) in its up half: their sum is J @ t.


def _permute_setup(ctx, inputs, output):
    tokens, expert_indices, num_experts = inputs
    ctx.save_for_backward(output[2])
    ctx.save_for_forward(expert_indices)
    ctx.tokens_dtype, ctx.num_experts = tokens.dtype, num_experts


def _permute_backward(ctx, dpermuted, _dsizes, _drow_map):
    (row_map,) = ctx.saved_tensors
    # Each token's gradient sums its k rows' gradients in slot order: unpermute without probs.
    return unpermute_op(incoming_grad(dpermuted, ctx.tokens_dtype), row_map, None), None, None


def _permute_jvp(ctx, t_tokens, *_):
    (expert_indices,) = ctx.saved_tensors
    return permute_op(t_tokens.contiguous(), expert_indices, ctx.num_experts)[0], None, None


permute_op.register_derivatives(_permute_backward, setup_context=_permute_setup, jvp=_permute_jvp)


def _unpermute_setup(ctx, inputs, output):
    permuted, row_map, probs = inputs
    ctx.save_for_backward(permuted, row_map, probs)
    ctx.save_for_forward(permuted, row_map, probs)


def _unpermute_backward(ctx, dout):
    permuted, row_map, probs = ctx.saved_tensors
    dpermuted, dprobs = unpermute_backward_op(incoming_grad(dout, permuted.dtype), permuted, row_map, probs)
    return dpermuted, None, None if probs is None else dprobs


def _unpermute_jvp(ctx, t_permuted, _t_row_map, t_probs):
    permuted, row_map, probs = ctx.saved_tensors
    terms = []
    if t_permuted is not None:
        terms.append(unpermute_op(t_permuted.contiguous(), row_map, probs))
    if t_probs is not None:
        terms.append(unpermute_op(permuted, row_map, t_probs.contiguous()))
    return sum(terms[1:], terms[0])


unpermute_op.register_derivatives(_unpermute_backward, setup_context=_unpermute_setup, jvp=_unpermute_jvp)


def _activation_setup(ctx, inputs, output):
    h, kind, _ = inputs
    ctx.save_for_backward(h)
    ctx.save_for_forward(h)
    ctx.kind, ctx.width = kind, output.shape[1]


def _activation_backward(ctx, dout):
    (h,) = ctx.saved_tensors
    return activation_backward_op(incoming_grad(dout, h.dtype), h, ctx.kind), None, None


def activation_tangent(t_h: Tensor, h: Tensor, kind: int, width: int) -> Tensor:
    """J(h) @ t_h, the activation's tangent (``width`` its output columns), from its backward."""
    t_h = t_h.contiguous()
    if contract.ACTIVATIONS[kind] != "swiglu":  # elementwise
        return activation_backward_op(t_h, h, kind)
    gate_part = activation_backward_op(t_h[:, :width].contiguous(), h, kind)[:, :width]
    up_part = activation_backward_op(t_h[:, width:].contiguous(), h, kind)[:, width:]
    return gate_part + up_part


def _activation_jvp(ctx, t_h, *_):
    (h,) = ctx.saved_tensors
    return activation_tangent(t_h, h, ctx.kind, ctx.width)


activation_op.register_derivatives(_activation_backward, setup_context=_activation_setup, jvp=_activation_jvp)


def _softmax_topk_setup(ctx, inputs, output):
    logits, _, renormalize = inputs
    _, indices = output
    ctx.save_for_backward(logits, indices)
    ctx.save_for_forward(logits, indices)
    ctx.renormalize = renormalize


def _softmax_topk_backward(ctx, dprobs, _dindices):
    logits, indices = ctx.saved_tensors
    dlogits = softmax_topk_backward_op(logits, indices, incoming_grad(dprobs, _router_probs_dtype(logits)),
                                       ctx.renormalize)
    return dlogits, None, None


def _softmax_topk_jvp(ctx, t_logits, *_):
    logits, indices = ctx.saved_tensors
    return softmax_topk_tangent_op(logits, indices, incoming_grad(t_logits, logits.dtype), ctx.renormalize), None


softmax_topk_op.register_derivatives(_softmax_topk_backward, setup_context=_softmax_topk_setup,
                                     jvp=_softmax_topk_jvp)
