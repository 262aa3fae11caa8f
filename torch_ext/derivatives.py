"""The derivatives of the GEMM ops, reverse (backward) and forward (jvp) mode, each
computed with the ops themselves on the same groups, so no group size is read on the host
and padding rows and empty groups keep their exact zeros.

- grouped_mm, ``out_g = x_g @ w_g + b_g``: backward ``dx`` (grouped_mm with the other
  transposition), ``dw`` (grouped_mm_wgrad), ``db`` (grouped_bias_grad), all three from
  one grouped_mm_backward call unless the backward may be differentiated again; tangent
  ``grouped_mm(t_x, w) + grouped_mm(x, t_w) + t_b`` on owned rows.
- grouped_mm_wgrad, ``out[g] = lhs_g^T @ grad_g``: backward ``dlhs_g = grad_g @ dout[g]^T``
  and ``dgrad_g = lhs_g @ dout[g]`` (grouped_mm); tangent ``wgrad(t_lhs, grad) +
  wgrad(lhs, t_grad)``.
- grouped_bias_grad, ``out[g] = sum of grad_g``: backward puts ``dout[g]`` on each row of
  group g (a grouped_mm with K = 0, whose rows are the bias); tangent ``bias_grad(t_grad)``.

An incoming gradient wider than the inputs (float32 for bfloat16) is rounded to the input
dtype once, and every gradient uses it (the JAX frontend does the same).
"""

import torch

from groupgemm.torch_ext.core_args import incoming_grad
from groupgemm.torch_ext.gemm_ops import (
    grouped_bias_grad_op,
    grouped_mm_backward_op,
    grouped_mm_op,
    grouped_mm_wgrad_accumulate_op,
    grouped_mm_wgrad_op,
)

Tensor = torch.Tensor


def _save(ctx, *tensors):
    ctx.save_for_backward(*tensors)
    ctx.save_for_forward(*tensors)


def _sum(terms):
    return sum(terms[1:], terms[0])


def _contiguous(tangent):
    return None if tangent is None else tangent.contiguous()


def bias_rows(bias: Tensor, num_rows: int, group_sizes, group_offset, out_dtype, group_ends=False) -> Tensor:
    """``[num_rows, N]``: each row owned by group g is ``bias[g]``, padding rows are 0 (a
    grouped_mm with K = 0)."""
    x = bias.new_empty((num_rows, 0))
    w = bias.new_empty((bias.shape[0], 0, bias.shape[1]))
    return grouped_mm_op(x, w, group_sizes, bias, group_offset, False, out_dtype, group_ends)


def backward_takes_separate_ops(grad: Tensor) -> bool:
    """Whether a grouped_mm's gradients come from the differentiable ops, one each: when they
    may be differentiated again (create_graph, a torch.func transform) or are batched
    (gradcheck's vmap over a backward); else from grouped_mm_backward's one call (the same
    bits)."""
    if torch._C.is_grad_enabled():
        return True
    # A compiled backward has neither; the checks below are not traceable.
    return not torch.compiler.is_compiling() and (torch._C._are_functorch_transforms_active()
                                                  or torch._C._functorch.is_legacy_batchedtensor(grad))


# ---- grouped_mm ------------------------------------------------------------------------


def input_and_bias_grads(ctx, grad, weight, group_sizes, group_offset, dtype):
    """dinput and dbias of a grouped_mm from the differentiable ops."""
    dinput = dbias = None
    if ctx.needs_input_grad[0]:
        dinput = grouped_mm_op(grad, weight, group_sizes, None, group_offset, not ctx.transpose_weight, dtype,
                               ctx.group_ends)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
        dbias = grouped_bias_grad_op(grad, group_sizes, weight.shape[0], group_offset, ctx.bias_dtype, ctx.group_ends)
    return dinput, dbias


def grouped_mm_grads(ctx, grad, input, weight, group_sizes, group_offset, accumulate_into=None):
    """(dinput, dweight, dbias) of a grouped_mm, each None unless asked for (ctx's
    needs_input_grad, transpose_weight, bias_dtype, group_ends); with accumulate_into the
    weight gradient is added into it instead. Shared by the op's autograd, the eager path
    and the main_grad layer."""
    needs = ctx.needs_input_grad
    want_dbias = ctx.bias_dtype is not None and needs[3]
    if not backward_takes_separate_ops(grad):
        dinput, dweight, dbias = grouped_mm_backward_op(
            input, weight, grad, group_sizes, accumulate_into, group_offset, ctx.transpose_weight, ctx.group_ends,
            needs[0], needs[1], ctx.bias_dtype if want_dbias else None)
        return (dinput if needs[0] else None, dweight if needs[1] and accumulate_into is None else None,
                dbias if want_dbias else None)
    dinput, dbias = input_and_bias_grads(ctx, grad, weight, group_sizes, group_offset, input.dtype)
    dweight = None
    if needs[1]:
        a, b = (grad, input) if ctx.transpose_weight else (input, grad)  # weight [G,N,K] or [G,K,N]
        if accumulate_into is None:
            dweight = grouped_mm_wgrad_op(a, b, group_sizes, weight.shape[0], group_offset, weight.dtype,
                                          ctx.group_ends)
        else:
            grouped_mm_wgrad_accumulate_op(a, b, group_sizes, accumulate_into, group_offset, ctx.group_ends)
    return dinput, dweight, dbias


def _grouped_mm_setup(ctx, inputs, output):
    input, weight, group_sizes, bias, group_offset, transpose_weight, _, group_ends = inputs
    _save(ctx, input, weight, group_sizes, group_offset)
    ctx.transpose_weight, ctx.group_ends = transpose_weight, group_ends
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.out_dtype = output.dtype


def _grouped_mm_backward(ctx, grad):
    input, weight, group_sizes, group_offset = ctx.saved_tensors
    grad = incoming_grad(grad, input.dtype)
    dinput, dweight, dbias = grouped_mm_grads(ctx, grad, input, weight, group_sizes, group_offset)
    return dinput, dweight, None, dbias, None, None, None, None


def _grouped_mm_jvp(ctx, t_input, t_weight, _t_sizes, t_bias, *_):
    input, weight, group_sizes, group_offset = ctx.saved_tensors
    t_bias = _contiguous(t_bias)

    def product(x, w, bias):
        return grouped_mm_op(x, w, group_sizes, bias, group_offset, ctx.transpose_weight, ctx.out_dtype, ctx.group_ends)

    terms = []
    if t_input is not None:
        terms.append(product(t_input.contiguous(), weight, t_bias))
        t_bias = None
    if t_weight is not None:
        terms.append(product(input, t_weight.contiguous(), t_bias))
        t_bias = None
    if t_bias is not None:
        terms.append(bias_rows(t_bias, input.shape[0], group_sizes, group_offset, ctx.out_dtype, ctx.group_ends))
    return _sum(terms)


grouped_mm_op.register_derivatives(_grouped_mm_backward, setup_context=_grouped_mm_setup, jvp=_grouped_mm_jvp)


# ---- grouped_mm_wgrad ------------------------------------------------------------------


def _wgrad_setup(ctx, inputs, output):
    input, grad, group_sizes, num_groups, group_offset, _, group_ends = inputs
    _save(ctx, input, grad, group_sizes, group_offset)
    ctx.num_groups, ctx.out_dtype, ctx.group_ends = num_groups, output.dtype, group_ends


def _wgrad_backward(ctx, dout):
    input, grad, group_sizes, group_offset = ctx.saved_tensors
    dout = incoming_grad(dout, input.dtype)  # [G, K, N]
    dinput = dgrad = None
    if ctx.needs_input_grad[0]:  # dinput_g = grad_g @ dout[g]^T: dout read as [G, N_out=K, K_in=N]
        dinput = grouped_mm_op(grad, dout, group_sizes, None, group_offset, True, input.dtype, ctx.group_ends)
    if ctx.needs_input_grad[1]:  # dgrad_g = input_g @ dout[g]
        dgrad = grouped_mm_op(input, dout, group_sizes, None, group_offset, False, grad.dtype, ctx.group_ends)
    return dinput, dgrad, None, None, None, None, None


def _wgrad_jvp(ctx, t_input, t_grad, *_):
    input, grad, group_sizes, group_offset = ctx.saved_tensors

    def product(a, b):
        return grouped_mm_wgrad_op(a, b, group_sizes, ctx.num_groups, group_offset, ctx.out_dtype, ctx.group_ends)

    terms = []
    if t_input is not None:
        terms.append(product(t_input.contiguous(), grad))
    if t_grad is not None:
        terms.append(product(input, t_grad.contiguous()))
    return _sum(terms)


grouped_mm_wgrad_op.register_derivatives(_wgrad_backward, setup_context=_wgrad_setup, jvp=_wgrad_jvp)


# ---- grouped_bias_grad -----------------------------------------------------------------


def _bias_grad_setup(ctx, inputs, output):
    grad, group_sizes, num_groups, group_offset, _, group_ends = inputs
    _save(ctx, group_sizes, group_offset)
    ctx.num_rows, ctx.grad_dtype = grad.shape[0], grad.dtype
    ctx.num_groups, ctx.out_dtype, ctx.group_ends = num_groups, output.dtype, group_ends


def _bias_grad_backward(ctx, dout):
    group_sizes, group_offset = ctx.saved_tensors
    dgrad = bias_rows(incoming_grad(dout, ctx.grad_dtype), ctx.num_rows, group_sizes, group_offset, ctx.grad_dtype,
                      ctx.group_ends)
    return dgrad, None, None, None, None, None


def _bias_grad_jvp(ctx, t_grad, *_):
    group_sizes, group_offset = ctx.saved_tensors
    return grouped_bias_grad_op(t_grad.contiguous(), group_sizes, ctx.num_groups, group_offset, ctx.out_dtype,
                                ctx.group_ends)


grouped_bias_grad_op.register_derivatives(_bias_grad_backward, setup_context=_bias_grad_setup, jvp=_bias_grad_jvp)
