"""The GEMM FLOPs of groupgemm's ops, for torch.utils.flop_counter (FlopCounterMode, and what
counts FLOPs through it: MFU meters, torch.compile's estimates). Without a formula an op counts
as 0 FLOPs.

A formula sees shapes only. Which rows a group owns lives on the device, and reading it would
be the host copy the ops never make, so every row counts as routed (each token slot, for the
expert MLP): exact for a dropless layer on one process, an upper bound where some rows belong
to no local group (expert parallelism's padding and other ranks' rows, dropped slots), which
the ops leave as zeros without multiplying them.
"""

import torch
from torch.utils.flop_counter import register_flop_formula

from groupgemm.torch_ext import expert_mlp_ops, fp8_ops, gemm_ops  # noqa: F401 - the ops this counts

ops = torch.ops.groupgemm


def _gemm(m, k, n) -> int:
    return 2 * m * k * n


@register_flop_formula(ops.grouped_mm)
def _grouped_mm(input, weight, *args, out_shape=None, **kwargs) -> int:
    return _gemm(input[0], input[1], out_shape[1])


# input [M, K], grad [M, N]: the [G, K, N] weight gradient.
@register_flop_formula([ops.grouped_mm_wgrad, ops.grouped_mm_wgrad_accumulate])
def _grouped_mm_wgrad(input, grad, *args, out_shape=None, **kwargs) -> int:
    return _gemm(input[0], input[1], grad[1])


@register_flop_formula(ops.grouped_mm_backward)
def _grouped_mm_backward(input, weight, grad, group_sizes, accumulate_into, group_offset=None, transpose_weight=False,
                         group_ends=False, input_grad=True, weight_grad=True, bias_dtype=None, out_shape=None) -> int:
    return (int(input_grad) + int(weight_grad)) * _gemm(input[0], input[1], grad[1])


# lhs [M, K], rhs [G, N, K].
@register_flop_formula(ops.scaled_grouped_mm)
def _scaled_grouped_mm(lhs, rhs, *args, out_shape=None, **kwargs) -> int:
    return _gemm(lhs[0], lhs[1], rhs[1])


# lhs [K, M], rhs [N, M]: the [G, K, N] weight gradient.
@register_flop_formula([ops.scaled_grouped_mm_wgrad, ops.scaled_grouped_mm_wgrad_accumulate])
def _scaled_grouped_mm_wgrad(lhs, rhs, *args, out_shape=None, **kwargs) -> int:
    return _gemm(lhs[1], lhs[0], rhs[0])


def _expert_mlp_sizes(tokens, expert_indices, w_in, w_out, transpose_rhs):
    """(slots, H, F_in, F): fc1 is [H] -> [F_in], fc2 [F] -> [H]."""
    slots = expert_indices[0] * expert_indices[1]
    f_in = w_in[1] if transpose_rhs else w_in[2]
    f = w_out[2] if transpose_rhs else w_out[1]
    return slots, tokens[1], f_in, f


@register_flop_formula(ops.expert_mlp)
def _expert_mlp(tokens, expert_indices, w_in, w_out, probs=None, b_in=None, b_out=None, group_offset=None, kind=0,
                transpose_rhs=False, want_h=True, out_shape=None) -> int:
    slots, hidden, f_in, f = _expert_mlp_sizes(tokens, expert_indices, w_in, w_out, transpose_rhs)
    return _gemm(slots, hidden, f_in) + _gemm(slots, f, hidden)


# The GEMMs the core runs for what `want` asks (dtokens, dw_in, dw_out, dprobs, db_in, db_out):
# dout @ w_out^T for every gradient but w_out's and b_out's, the input gradients' GEMM, and
# each weight gradient's.
@register_flop_formula(ops.expert_mlp_backward)
def _expert_mlp_backward(dout, tokens, expert_indices, w_in, w_out, h, want, probs=None, b_out=None,
                         group_offset=None, kind=0, transpose_rhs=False, out_shape=None) -> int:
    slots, hidden, f_in, f = _expert_mlp_sizes(tokens, expert_indices, w_in, w_out, transpose_rhs)
    dtokens, dw_in, dw_out, dprobs, db_in, _ = want
    fc1, fc2 = _gemm(slots, hidden, f_in), _gemm(slots, f, hidden)
    return (fc2 * int(dtokens or dw_in or dprobs or db_in) + fc1 * int(dtokens) + fc1 * int(dw_in)
            + fc2 * int(dw_out))
