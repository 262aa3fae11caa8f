"""GroupedLinear(fp8=...): the FP8 training recipe (groupgemm/_fp8_recipe.py) as a
torch.autograd.Function over the FP8 ops, with Megatron-core's main_grad accumulation
(main_grad.py) kept: the weight gradient is then added into the float32 main_grad by the
FP8 weight-gradient GEMM itself. Reverse mode only (the FP8 GEMMs are the derivative)."""

import torch
from torch.autograd import forward_ad

from groupgemm import _contract as contract
from groupgemm import _fp8_recipe as recipe_steps
from groupgemm.torch_ext import core_args, fp8_ops, gemm_ops, main_grad

Tensor = torch.Tensor


class _Ops:
    """The recipe's operations on torch tensors (float8_e4m3fn throughout)."""

    @staticmethod
    def dtype(t):
        return t.dtype

    @staticmethod
    def transpose(w):
        return w.transpose(-2, -1).contiguous()

    @staticmethod
    def quantize_rows(x, recipe):
        return fp8_ops.fp8_quantize_rows_op(x, recipe_steps.FP8_E4M3, contract.fp8_recipe(recipe, "fp8"))

    @staticmethod
    def quantize_weight(w, recipe):
        if recipe == "blockwise":
            return fp8_ops.fp8_quantize_blocks_op(w, recipe_steps.FP8_E4M3)
        g, n, k = w.shape
        q, scale = fp8_ops.fp8_quantize_rows_op(w.reshape(g * n, k), recipe_steps.FP8_E4M3, 0)
        return q.reshape(g, n, k), scale.reshape(g, n)

    @staticmethod
    def quantize_grouped(x, group_sizes, group_offset, num_groups, recipe):
        return fp8_ops.fp8_quantize_grouped_op(x, group_sizes, num_groups, recipe_steps.FP8_E4M3,
                                               contract.fp8_recipe(recipe, "fp8"), False, group_offset)

    @staticmethod
    def scaled_mm(q, qw, s, sw, group_sizes, group_offset, bias, recipe, dtype):
        return fp8_ops.scaled_grouped_mm_op(q, qw, s, sw, group_sizes, contract.fp8_recipe(recipe, "fp8"), dtype, bias,
                                            group_offset)

    @staticmethod
    def scaled_wgrad(a, b, sa, sb, group_sizes, group_offset, num_groups, recipe, dtype, accumulate_into):
        scaling = contract.fp8_recipe(recipe, "fp8")
        if accumulate_into is None:
            return fp8_ops.scaled_grouped_mm_wgrad_op(a, b, sa, sb, group_sizes, num_groups, scaling, dtype,
                                                      group_offset)
        fp8_ops.scaled_grouped_mm_wgrad_accumulate_op(a, b, sa, sb, group_sizes, scaling, accumulate_into,
                                                      group_offset)
        return accumulate_into


class _Fp8GroupedLinear(torch.autograd.Function):
    """y = x @ weight[g]^T (+ bias[g]) per group, the weight [G, N, K], in FP8."""

    @staticmethod
    def forward(input, weight, group_sizes, bias, recipe, accumulate_into, returns_placeholder):
        return recipe_steps.forward(_Ops, input, weight, group_sizes, None, bias, recipe, True)

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, group_sizes, bias, recipe, accumulate_into, returns_placeholder = inputs
        ctx.save_for_backward(input, weight, group_sizes)
        # An attribute, not saved: other microbatches' backwards add into it meanwhile.
        ctx.accumulate_into, ctx.returns_placeholder = accumulate_into, returns_placeholder
        ctx.recipe, ctx.bias_dtype = recipe, None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, grad):
        input, weight, group_sizes = ctx.saved_tensors
        grad = core_args.incoming_grad(grad, input.dtype)
        g = weight.shape[0]
        dinput = dweight = dbias = None
        if ctx.needs_input_grad[0]:
            dinput = recipe_steps.input_grad(_Ops, grad, weight, group_sizes, None, ctx.recipe, True, input.dtype)
        if ctx.accumulate_into is not None:
            recipe_steps.weight_grad(_Ops, input, grad, group_sizes, None, g, ctx.recipe, True, weight.dtype,
                                     ctx.accumulate_into)
            dweight = weight.new_zeros(()).expand(weight.shape) if ctx.returns_placeholder else None
        elif ctx.needs_input_grad[1]:
            dweight = recipe_steps.weight_grad(_Ops, input, grad, group_sizes, None, g, ctx.recipe, True, weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
            dbias = gemm_ops.grouped_bias_grad_op(grad, group_sizes, g, None, ctx.bias_dtype)
        return dinput, dweight, None, dbias, None, None, None


def grouped_linear(input: Tensor, weight: Tensor, group_sizes: Tensor, bias: Tensor | None, recipe: str,
                   accumulate_into_main_grad: bool) -> Tensor:
    """GroupedLinear's product in FP8 (arguments checked, group_sizes as the core reads it);
    with accumulate_into_main_grad, the weight gradient goes to weight.main_grad."""
    if not torch.compiler.is_compiling() and (
            torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0):
        raise RuntimeError("GroupedLinear(fp8=...) supports reverse mode only; forward-mode AD and torch.func "
                           "transforms need fp8=None")
    accumulate_into, returns_placeholder = None, False
    if accumulate_into_main_grad and main_grad.needs_main_grad(weight):
        returns_placeholder = hasattr(weight, "grad_added_to_main_grad")
        if returns_placeholder and not torch.compiler.is_compiling():
            main_grad.attach(weight)
        accumulate_into = main_grad.checked_main_grad(weight)
    return _Fp8GroupedLinear.apply(input.contiguous(), weight.contiguous(), group_sizes,
                                   None if bias is None else bias.contiguous(), recipe, accumulate_into,
                                   returns_placeholder)
