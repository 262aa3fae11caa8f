"""groupgemm.torch behind the tests' frontend surface (see frontends.py). No jax here."""

import contextlib

import numpy as np
import torch
from cases import host_rounded, inputs

import groupgemm.torch as gt
from groupgemm import _contract

NAME = "torch"
NAMES = _contract.TORCH_NAMES


def precision(dtype):
    return contextlib.nullcontext()


def array(values, dtype, device="cpu"):
    """values (NumPy or nested lists) as a tensor of the dtype named `dtype`."""
    if dtype in _contract.FP8_DTYPES:  # NumPy's float8 (ml_dtypes) reaches torch as its bytes
        as_bytes = np.ascontiguousarray(np.asarray(values).astype(dtype)).view(np.uint8)
        return torch.from_numpy(as_bytes).view(getattr(torch, dtype)).to(device)
    return torch.from_numpy(np.ascontiguousarray(host_rounded(values, dtype))).to(device=device,
                                                                                 dtype=getattr(torch, dtype))


def to_float64(t):
    return t.detach().cpu().to(torch.float64).numpy() if isinstance(t, torch.Tensor) else np.asarray(t, np.float64)


def matmul(lhs, rhs, sizes, *, bias=None, transpose=False, offset=None, out_dtype=None):
    return gt.grouped_mm(lhs, rhs, sizes, bias, transpose_weight=transpose, group_offset=offset, out_dtype=out_dtype)


def wgrad(lhs, grad, sizes, num_groups, *, offset=None, accumulate_into=None, out_dtype=None):
    if out_dtype is not None:
        raise TypeError("grouped_mm_wgrad: the output dtype is the input dtype (or accumulate_into's)")
    return gt.grouped_mm_wgrad(lhs, grad, sizes, num_groups, group_offset=offset, accumulate_into=accumulate_into)


def accumulate(lhs, grad, sizes, num_groups, acc, offset=None):
    """acc + the weight gradient, added in place: returns acc itself."""
    result = wgrad(lhs, grad, sizes, num_groups, offset=offset, accumulate_into=acc)
    assert result is acc
    return result


def _dirty_allocator(numel, dtype):
    """Leaves freed NaN-filled blocks behind so fresh outputs likely reuse dirty memory."""
    for _ in range(4):
        torch.full((max(numel, 1),), float("nan"), dtype=dtype)


def forward_backward(case, dtype, with_bias, transpose, device="cpu"):
    """[out, dinput, dweight, dbias] of a case's inputs in `dtype` (dbias is None without bias)."""
    x = inputs(case)
    rhs = x["rhs"].transpose(0, 2, 1) if transpose else x["rhs"]
    torch_dtype = getattr(torch, dtype)
    lhs_t, rhs_t, bias_t = (array(a, dtype, device).requires_grad_() for a in (x["lhs"], rhs, x["bias"]))
    offset = None if case.group_offset is None else torch.tensor(case.group_offset, device=device)
    if device == "cpu":
        _dirty_allocator(case.m * max(case.n, case.k), torch_dtype)
    out = matmul(lhs_t, rhs_t, torch.from_numpy(x["group_sizes"]).to(device), bias=bias_t if with_bias else None,
                 transpose=transpose, offset=offset)
    out.backward(array(x["dout"], dtype, device))
    return [out, lhs_t.grad, rhs_t.grad, bias_t.grad if with_bias else None]


def check_float64_gradients(fn, args):
    """Gradients of fn against finite differences (torch.autograd.gradcheck), in float64."""
    leaves = [torch.tensor(np.asarray(a), dtype=torch.float64, requires_grad=True) for a in args]
    assert torch.autograd.gradcheck(fn, leaves)


def cast(t, dtype):
    return t.to(getattr(torch, dtype))


def dtype_of(t):
    return str(t.dtype).removeprefix("torch.")


def matmul_and_grads(lhs, rhs, sizes, dout, offset=None, dtype="float32", out_dtype=None):
    """out, dinput, dweight of a grouped matmul of NumPy inputs in `dtype` (dout in the
    output's dtype), as float64 NumPy."""
    lhs_t, rhs_t = array(lhs, dtype).requires_grad_(), array(rhs, dtype).requires_grad_()
    out = matmul(lhs_t, rhs_t, torch.from_numpy(sizes), offset=offset,
                 out_dtype=None if out_dtype is None else getattr(torch, out_dtype))
    out.backward(array(dout, str(out.dtype).removeprefix("torch.")))
    return [to_float64(t) for t in (out, lhs_t.grad, rhs_t.grad)]


# ---- the expert layer ----------------------------------------------------------------


def _leaf(values, dtype, device="cpu"):
    return None if values is None else array(values, dtype, device).requires_grad_()


def permute_and_grad(tokens, expert_indices, num_experts, dpermuted, dtype, device="cpu"):
    """permuted, group_sizes, row_map and d tokens, from NumPy inputs."""
    tokens_t = _leaf(tokens, dtype, device)
    indices = torch.from_numpy(np.asarray(expert_indices)).to(device)
    permuted, sizes, row_map = gt.permute(tokens_t, indices, num_experts)
    permuted.backward(array(dpermuted, dtype, device))
    return permuted, sizes, row_map, tokens_t.grad


def unpermute_and_grads(permuted, row_map, probs, dout, dtype, probs_dtype, device="cpu"):
    """out, d permuted and d probs (None without probs), from NumPy inputs."""
    permuted_t, probs_t = _leaf(permuted, dtype, device), _leaf(probs, probs_dtype, device)
    out = gt.unpermute(permuted_t, torch.from_numpy(np.asarray(row_map, np.int32)).to(device), probs_t)
    out.backward(array(dout, dtype, device))
    return out, permuted_t.grad, None if probs_t is None else probs_t.grad


def grouped_mlp_and_grads(x, w_in, w_out, sizes, activation, b_in, b_out, dout, dtype, device="cpu"):
    """y and the gradients of x, w_in, w_out, b_in, b_out (None for an absent bias), through
    GroupedMLP (weights w_in [E, F_in, H], w_out [E, H, F])."""
    e, _, h = w_in.shape
    mlp = gt.GroupedMLP(e, h, w_out.shape[2], activation=activation, bias=b_in is not None,
                        device=device, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for param, values in ((mlp.fc1.weight, w_in), (mlp.fc2.weight, w_out), (mlp.fc1.bias, b_in),
                              (mlp.fc2.bias, b_out)):
            if param is not None:
                param.copy_(array(values, dtype, device))
    x_t = _leaf(x, dtype, device)
    y = mlp(x_t, torch.from_numpy(np.asarray(sizes, np.int32)).to(device))
    y.backward(array(dout, dtype, device))
    biases = (None, None) if b_in is None else (mlp.fc1.bias.grad, mlp.fc2.bias.grad)
    return y, (x_t.grad, mlp.fc1.weight.grad, mlp.fc2.weight.grad, *biases)


def softmax_topk_and_grad(logits, k, renormalize, dprobs, dtype, device="cpu"):
    """probs, expert_indices and d logits, from NumPy inputs."""
    logits_t = _leaf(logits, dtype, device)
    probs, indices = gt.softmax_topk(logits_t, k, renormalize=renormalize)
    probs.backward(torch.from_numpy(np.asarray(dprobs)).to(device, probs.dtype))
    return probs, indices, logits_t.grad


def softmax_topk_tangent(logits, k, renormalize, tlogits, dtype, device="cpu"):
    """The forward-mode tangent of softmax_topk's probs (torch.func.jvp), from NumPy inputs."""
    probs = lambda x: gt.softmax_topk(x, k, renormalize=renormalize)[0]  # noqa: E731
    return torch.func.jvp(probs, (array(logits, dtype, device),), (array(tlogits, dtype, device),))[1]


def shape_only(fn, *specs):
    """fn called on meta tensors: a shape and a dtype, no memory."""
    return fn(*(torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for shape, dtype in specs))


permute, unpermute, softmax_topk = gt.permute, gt.unpermute, gt.softmax_topk


def mlp_with_activation(name):
    return gt.GroupedMLP(2, 8, 6, activation=name)


# ---- FP8 -----------------------------------------------------------------------------

FP8_NAMES = _contract.FP8_TORCH_NAMES
def _scalings(form, recipe):
    """torch's ScalingType names of a recipe (an unknown recipe passed through as both)."""
    return _contract.torch_fp8_scalings(form, recipe) if recipe in _contract.FP8_RECIPES else (recipe, recipe)


def _torch_dtype(name):
    return None if name is None else getattr(torch, name)


def quantize_fp8(x, recipe, *, dtype="float8_e4m3fn", power_of_two=False):
    return gt.quantize_fp8(x, recipe, dtype=getattr(torch, dtype), power_of_two=power_of_two)


def quantize_fp8_grouped(x, sizes, recipe, *, num_groups=None, offset=None, dtype="float8_e4m3fn",
                         power_of_two=False):
    return gt.quantize_fp8_grouped(x, sizes, recipe, num_groups=num_groups, group_offset=offset,
                                   dtype=getattr(torch, dtype), power_of_two=power_of_two)


def scaled_matmul(lhs, rhs, sizes, lhs_scale, rhs_scale, recipe, *, bias=None, offset=None, out_dtype=None):
    """rhs [G, N, K] (the core's layout): torch's mat_b is its transposed view."""
    recipe_a, recipe_b = _scalings("2d-3d", recipe)
    return gt.scaled_grouped_mm(lhs, rhs.transpose(-2, -1), lhs_scale, recipe_a, rhs_scale, recipe_b, bias=bias,
                                output_dtype=_torch_dtype(out_dtype or "bfloat16"), group_sizes=sizes,
                                group_offset=offset)


def scaled_wgrad(lhs, rhs, sizes, lhs_scale, rhs_scale, recipe, *, num_groups=None, offset=None, out_dtype=None,
                 accumulate_into=None):
    """lhs [K, M], rhs [N, M]: torch's mat_b [M, N] is rhs's transposed view."""
    recipe_a, recipe_b = _scalings("2d-2d", recipe)
    return gt.scaled_grouped_mm(lhs, rhs.transpose(-2, -1), lhs_scale, recipe_a, rhs_scale, recipe_b,
                                output_dtype=None if out_dtype is None else _torch_dtype(out_dtype), group_sizes=sizes,
                                group_offset=offset, num_groups=num_groups, accumulate_into=accumulate_into)


def fp8_linear_and_grads(x, weight, sizes, bias, dout, recipe, dtype, acc=None, device="cpu"):
    """y and the gradients of x, weight and bias (None without bias) of GroupedLinear(fp8=recipe)
    (weight [G, N, K]); with acc, the weight gradient accumulated into a float32 main_grad
    starting at acc, returned in the weight gradient's place."""
    g, n, k = weight.shape
    layer = gt.GroupedLinear(g, k, n, bias=bias is not None, device=device, dtype=getattr(torch, dtype), fp8=recipe,
                             accumulate_into_main_grad=acc is not None)
    with torch.no_grad():
        layer.weight.copy_(array(weight, dtype, device))
        if bias is not None:
            layer.bias.copy_(array(bias, dtype, device))
    if acc is not None:
        layer.weight.main_grad = array(acc, "float32", device)
    x_t = _leaf(x, dtype, device)
    y = layer(x_t, torch.from_numpy(np.asarray(sizes, np.int32)).to(device))
    y.backward(array(dout, dtype, device))
    dweight = layer.weight.main_grad if acc is not None else layer.weight.grad
    return y, (x_t.grad, dweight, None if bias is None else layer.bias.grad)
