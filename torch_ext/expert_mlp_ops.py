"""The fused expert MLP for PyTorch (groupgemm/expert_mlp.h): custom ops ``groupgemm::expert_mlp``
and ``groupgemm::expert_mlp_backward``, and the first's autograd.

The forward returns ``(out [T, H], h [T, k, F_in])``: h, fc1's output per slot, is what
the backward reads (with the inputs and the routing); the public function drops it, and
asks for it only when a derivative may be taken. Reverse mode is the backward op, one core
call; forward mode is the composition's tangent (permute, the grouped MLP's tangent,
unpermute), built from the expert layer's ops. Like the other ops, each allocates its
outputs with torch and hands every tensor to the core zero-copy; the [T*k, H] scratch
rows live for the call only.
"""

import functools
import typing

import torch

from groupgemm import _contract as contract
from groupgemm import _core
from groupgemm.torch_ext import device_scratch, gemm_ops
from groupgemm.torch_ext.core_args import capsule, incoming_grad, require
from groupgemm.torch_ext.expert_ops import activation_op, activation_tangent, permute_op, unpermute_op
from groupgemm.torch_ext.op_library import allocator, define

Tensor = torch.Tensor


def _scratch(tokens: Tensor, num_slots: int, w_in: Tensor, kind: int, transpose_rhs: bool,
             backward: bool) -> Tensor | None:
    """The CUDA call's workspace (the routing, the GEMMs' per-expert arrays, the row scratch);
    None on the CPU."""
    if tokens.device.type != "cuda":
        return None
    nbytes = _core.expert_mlp_workspace_bytes(_core.Device.cuda, num_slots, w_in.shape[0], tokens.shape[1],
                                              _in_features(w_in, transpose_rhs), kind, tokens.element_size(),
                                              backward)
    return torch.empty(nbytes, dtype=torch.uint8, device=tokens.device)


def _in_features(w_in: Tensor, transpose_rhs: bool) -> int:
    return w_in.shape[1] if transpose_rhs else w_in.shape[2]


def _expert_mlp_outputs(tokens, expert_indices, w_in, w_out, probs, b_in, b_out, transpose_rhs, want_h, empty):
    require("expert_mlp", (tokens, 2, "tokens"), (expert_indices, 2, "expert_indices"), (w_in, 3, "w_in"),
            (w_out, 3, "w_out"), (probs, 2, "probs"), (b_in, 2, "b_in"), (b_out, 2, "b_out"))
    t, k = expert_indices.shape
    h_shape = (t, k, _in_features(w_in, transpose_rhs)) if want_h else (0,)
    return empty((t, tokens.shape[1]), tokens.dtype), empty(h_shape, tokens.dtype)


@define("expert_mlp", _expert_mlp_outputs)
def expert_mlp_op(tokens: Tensor, expert_indices: Tensor, w_in: Tensor, w_out: Tensor, probs: Tensor | None = None,
                  b_in: Tensor | None = None, b_out: Tensor | None = None, group_offset: Tensor | None = None,
                  kind: int = 0, transpose_rhs: bool = False, want_h: bool = True) -> tuple[Tensor, Tensor]:
    """(out, h); h is a size-0 tensor unless want_h."""
    out, h = _expert_mlp_outputs(tokens, expert_indices, w_in, w_out, probs, b_in, b_out, transpose_rhs, want_h,
                                 allocator(tokens.device))
    rows = torch.empty((expert_indices.numel(), tokens.shape[1]), dtype=tokens.dtype, device=tokens.device)
    workspace = _scratch(tokens, expert_indices.numel(), w_in, kind, transpose_rhs, backward=False)
    _core.expert_mlp(*map(capsule, (tokens, expert_indices, probs, w_in, w_out, b_in, b_out, group_offset, out)),
                     capsule(h) if want_h else None, capsule(rows), capsule(workspace), kind=kind,
                     transpose_rhs=transpose_rhs, stream=device_scratch.stream(tokens.device))
    return out, h


def _expert_mlp_backward_outputs(dout, tokens, expert_indices, w_in, w_out, h, probs, b_out, transpose_rhs, want,
                                 empty):
    require("expert_mlp_backward", (dout, 2, "dout"), (tokens, 2, "tokens"), (expert_indices, 2, "expert_indices"),
            (w_in, 3, "w_in"), (w_out, 3, "w_out"), (h, 3, "h"), (probs, 2, "probs"), (b_out, 2, "b_out"))
    if len(want) != 6:
        raise ValueError(f"groupgemm::expert_mlp_backward: want has {len(want)} flags, expected 6")
    e, f_in, hidden = w_in.shape[0], _in_features(w_in, transpose_rhs), tokens.shape[1]
    probs_dtype = tokens.dtype if probs is None else probs.dtype
    shapes = (tokens.shape, w_in.shape, w_out.shape, expert_indices.shape, (e, f_in), (e, hidden))
    dtypes = (tokens.dtype,) * 3 + (probs_dtype,) + (tokens.dtype,) * 2
    return tuple(empty(tuple(shape) if wanted else (0,), dtype) for shape, dtype, wanted in zip(shapes, dtypes, want))


# The gradients of (tokens, w_in, w_out, probs, b_in, b_out) from one core call, each an
# empty tensor unless `want` asks for it (typing.Sequence[bool]: torch 2.6's schema inference
# reads no built-in list[bool]). Not differentiable itself (a second derivative
# raises, naming the op).
@define("expert_mlp_backward", _expert_mlp_backward_outputs)
def expert_mlp_backward_op(dout: Tensor, tokens: Tensor, expert_indices: Tensor, w_in: Tensor, w_out: Tensor,
                           h: Tensor, want: typing.Sequence[bool], probs: Tensor | None = None,
                           b_out: Tensor | None = None, group_offset: Tensor | None = None, kind: int = 0,
                           transpose_rhs: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = _expert_mlp_backward_outputs(dout, tokens, expert_indices, w_in, w_out, h, probs, b_out, transpose_rhs,
                                         want, allocator(tokens.device))
    rows = torch.empty((expert_indices.numel(), tokens.shape[1]) if want[0] else (0,), dtype=tokens.dtype,
                       device=tokens.device)
    workspace = _scratch(tokens, expert_indices.numel(), w_in, kind, transpose_rhs, backward=True)
    _core.expert_mlp_backward(
        *map(capsule, (dout, tokens, expert_indices, probs, w_in, w_out, b_out, group_offset, h)),
        *(capsule(g) if wanted else None for g, wanted in zip(grads, want)), capsule(rows) if want[0] else None,
        capsule(workspace), kind=kind, transpose_rhs=transpose_rhs, stream=device_scratch.stream(tokens.device))
    return grads


# ---- derivatives ----------------------------------------------------------------------------
# Reverse mode: the backward op, from what setup saved (the inputs and h). Forward mode: the
# composition's tangent. h is the backward's input, not a result to differentiate.

_DIFFERENTIABLE = (0, 2, 3, 4, 5, 6)  # tokens, w_in, w_out, probs, b_in, b_out among the op's inputs


def _setup(ctx, inputs, output):
    tokens, expert_indices, w_in, w_out, probs, b_in, b_out, group_offset, kind, transpose_rhs, want_h = inputs
    _, h = output
    ctx.mark_non_differentiable(h)
    ctx.set_materialize_grads(False)  # no zeros the size of h for its gradient, which never comes
    ctx.save_for_backward(tokens, expert_indices, w_in, w_out, probs, b_out, group_offset, h)
    ctx.save_for_forward(tokens, expert_indices, w_in, w_out, probs, b_out, group_offset, h)
    ctx.kind, ctx.transpose_rhs, ctx.want_h = kind, transpose_rhs, want_h


def _saved(ctx, saved):
    if not ctx.want_h:
        raise RuntimeError("groupgemm::expert_mlp was called with want_h=False: it kept nothing to differentiate")
    return saved


def _backward(ctx, dout, _dh):
    if dout is None:
        return (None,) * 11
    tokens, expert_indices, w_in, w_out, probs, b_out, group_offset, h = _saved(ctx, ctx.saved_tensors)
    want = [ctx.needs_input_grad[i] for i in _DIFFERENTIABLE]
    grads = expert_mlp_backward_op(incoming_grad(dout, tokens.dtype), tokens, expert_indices, w_in, w_out, h, want,
                                   probs, b_out, group_offset, ctx.kind, ctx.transpose_rhs)
    dtokens, dw_in, dw_out, dprobs, db_in, db_out = (g if w else None for g, w in zip(grads, want))
    return dtokens, None, dw_in, dw_out, dprobs, db_in, db_out, None, None, None, None


class _Composition:
    """The expert layer as permute, the grouped MLP and unpermute compute it, from the
    fused op's operands: the rows, each piece made when first used."""

    def __init__(self, tokens, expert_indices, w_in, w_out, probs, b_out, group_offset, h, kind, transpose_rhs):
        self.w_in, self.w_out, self.probs, self.b_out, self.h = w_in, w_out, probs, b_out, h
        self.kind, self.transpose = kind, transpose_rhs
        self.experts = w_in.shape[0]
        self.local = window_ids(expert_indices, group_offset, self.experts)
        self.x, self.sizes, self.row_map = permute_op(tokens, self.local, self.experts)

    def rows(self, x: Tensor) -> Tensor:
        return permute_op(x.contiguous(), self.local, self.experts)[0]

    @functools.cached_property
    def h_rows(self):
        t, k, f_in = self.h.shape
        return permute_op(self.h.reshape(t * k, f_in), self.local.reshape(t * k, 1), self.experts)[0]

    @functools.cached_property
    def width(self):
        return contract.activation_width(contract.ACTIVATIONS[self.kind], self.h.shape[-1], "expert_mlp")

    @functools.cached_property
    def act(self):
        return activation_op(self.h_rows, self.kind, self.width)

    def matmul(self, lhs: Tensor, rhs: Tensor, bias: Tensor | None = None) -> Tensor:
        return gemm_ops.grouped_mm_op(lhs.contiguous(), rhs.contiguous(), self.sizes, bias, None, self.transpose)

    def bias_rows(self, bias: Tensor) -> Tensor:
        """out[r] = bias[e] for the rows of expert e: a product over K = 0."""
        e, n = bias.shape
        return gemm_ops.grouped_mm_op(bias.new_zeros((self.x.shape[0], 0)), bias.new_zeros((e, 0, n)), self.sizes,
                                      bias.contiguous())


def window_ids(expert_indices: Tensor, group_offset: Tensor | None, num_experts: int) -> Tensor:
    """Each slot's local expert, or -1 when it is dropped (groupgemm/expert_mlp.h's
    window_bucket), int32."""
    ids = expert_indices.to(torch.int64)
    local = ids if group_offset is None else ids - group_offset.to(torch.int64)
    inside = (ids >= 0) & (local >= 0) & (local < num_experts)  # a difference past int64 wraps below 0
    return torch.where(inside, local, -1).to(torch.int32)


def _jvp(ctx, t_tokens, _t_indices, t_w_in, t_w_out, t_probs, t_b_in, t_b_out, *_):
    tokens, expert_indices, w_in, w_out, probs, b_out, group_offset, h = _saved(ctx, ctx.saved_tensors)
    c = _Composition(tokens, expert_indices, w_in, w_out, probs, b_out, group_offset, h, ctx.kind, ctx.transpose_rhs)
    t_h = [c.matmul(c.rows(t_tokens), w_in) if t_tokens is not None else None,
           c.matmul(c.x, t_w_in) if t_w_in is not None else None,
           c.bias_rows(t_b_in) if t_b_in is not None else None]
    t_y = [c.matmul(c.act, t_w_out) if t_w_out is not None else None,
           c.bias_rows(t_b_out) if t_b_out is not None else None]
    t_h = [t for t in t_h if t is not None]
    if t_h:
        t_y.append(c.matmul(activation_tangent(sum(t_h[1:], t_h[0]), c.h_rows, ctx.kind, c.width), w_out))
    t_y = [t for t in t_y if t is not None]
    terms = [unpermute_op(sum(t_y[1:], t_y[0]), c.row_map, probs)] if t_y else []
    if t_probs is not None:
        terms.append(unpermute_op(c.matmul(c.act, w_out, b_out), c.row_map, t_probs.contiguous()))
    t_out = sum(terms[1:], terms[0]) if terms else torch.zeros_like(tokens)
    return t_out, None


expert_mlp_op.register_derivatives(_backward, setup_context=_setup, jvp=_jvp)
