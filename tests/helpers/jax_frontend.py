"""groupgemm.jax behind the tests' frontend surface (see frontends.py). No torch here."""

import contextlib

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
from cases import host_rounded, inputs

import groupgemm.jax as gj
from groupgemm import _contract

NAME = "jax"
NAMES = _contract.JAX_NAMES


def x64(enabled=True):
    """jax.enable_x64 as a context manager (jax.experimental's before jax 0.7)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:
        from jax.experimental import enable_x64 as enable
    return enable(enabled)


def precision(dtype):
    """The context a dtype's arrays need: float64 exists only with x64 on."""
    return x64(dtype == "float64")


def _device(kind):
    return jax.devices("cpu" if kind == "cpu" else "gpu")[0]


def array(values, dtype, device="cpu"):
    return jax.device_put(jnp.asarray(host_rounded(values, dtype), dtype), _device(device))


def to_float64(a):
    return np.asarray(a).astype(np.float64)  # NumPy (ml_dtypes for bfloat16) widens exactly


def matmul(lhs, rhs, sizes, *, bias=None, transpose=False, offset=None, out_dtype=None):
    return gj.grouped_matmul(lhs, rhs, sizes, bias=bias, transpose_rhs=transpose, group_offset=offset,
                             preferred_element_type=out_dtype)


def wgrad(lhs, grad, sizes, num_groups, *, offset=None, accumulate_into=None, out_dtype=None):
    return gj.grouped_matmul_wgrad(lhs, grad, sizes, num_groups=num_groups, group_offset=offset,
                                   accumulate_into=accumulate_into, preferred_element_type=out_dtype)


def accumulate(lhs, grad, sizes, num_groups, acc, offset=None):
    """acc + the weight gradient, as a jitted step that donates acc (updated in place)."""
    step = jax.jit(lambda a: wgrad(lhs, grad, sizes, num_groups, offset=offset, accumulate_into=a), donate_argnums=0)
    return step(acc)


def forward_backward(case, dtype, with_bias, transpose, device="cpu"):
    """[out, dlhs, drhs, dbias] of a case's inputs in `dtype` (dbias is None without bias)."""
    x = inputs(case)
    rhs = x["rhs"].transpose(0, 2, 1) if transpose else x["rhs"]
    offset = None if case.group_offset is None else jnp.int32(case.group_offset)
    with precision(dtype), jax.default_device(_device(device)):
        sizes = jnp.asarray(x["group_sizes"])
        args = [array(a, dtype, device) for a in (x["lhs"], rhs) + ((x["bias"],) if with_bias else ())]
        out, vjp = jax.vjp(lambda l, r, *b: matmul(l, r, sizes, bias=b[0] if b else None, transpose=transpose,
                                                   offset=offset), *args)
        grads = [np.asarray(a) for a in (out, *vjp(array(x["dout"], dtype, device)))]
        return grads + [None] * (4 - len(grads))


def check_float64_gradients(fn, args):
    """Reverse-mode gradients of fn against finite differences, in float64."""
    with x64():
        jax.test_util.check_grads(fn, tuple(jnp.asarray(a, jnp.float64) for a in args), order=1, modes=["rev"])


def cast(a, dtype):
    return jnp.asarray(a).astype(dtype)


def dtype_of(a):
    return np.dtype(a.dtype).name


def matmul_and_grads(lhs, rhs, sizes, dout, offset=None, dtype="float32", out_dtype=None):
    """out, dlhs, drhs of a grouped matmul of NumPy inputs in `dtype` (dout in the output's
    dtype), as float64 NumPy."""
    out, vjp = jax.vjp(lambda l, r: matmul(l, r, jnp.asarray(sizes), offset=offset, out_dtype=out_dtype),
                       array(lhs, dtype), array(rhs, dtype))
    return [to_float64(a) for a in (out, *vjp(array(dout, out.dtype.name)))]


# ---- the expert layer ----------------------------------------------------------------


def _on(device):
    """Arrays made inside go to `device` ("cpu" or "cuda"); None: JAX's default device."""
    return contextlib.nullcontext() if device is None else jax.default_device(_device(device))


def permute_and_grad(tokens, expert_indices, num_experts, dpermuted, dtype, device=None):
    """permuted, group_sizes, row_map and d tokens, from NumPy inputs."""
    with precision(dtype), _on(device):
        indices = jnp.asarray(expert_indices)
        permuted, vjp, (sizes, row_map) = jax.vjp(
            lambda t: (lambda p, s, r: (p, (s, r)))(*gj.permute(t, indices, num_experts)), jnp.asarray(tokens, dtype),
            has_aux=True)
        (dtokens,) = vjp(jnp.asarray(dpermuted, dtype))
        return permuted, sizes, row_map, dtokens


def unpermute_and_grads(permuted, row_map, probs, dout, dtype, probs_dtype, device=None):
    """out, d permuted and d probs (None without probs), from NumPy inputs."""
    with precision(dtype), _on(device):
        row_map = jnp.asarray(row_map, jnp.int32)
        args = [jnp.asarray(permuted, dtype)] + ([] if probs is None else [jnp.asarray(probs, probs_dtype)])
        out, vjp = jax.vjp(lambda p, *q: gj.unpermute(p, row_map, *q), *args)
        grads = vjp(jnp.asarray(dout, dtype))
        return out, grads[0], None if probs is None else grads[1]


def grouped_mlp_and_grads(x, w_in, w_out, sizes, activation, b_in, b_out, dout, dtype, device=None):
    """y and the gradients of x, w_in, w_out, b_in, b_out (None for an absent bias); the
    weights in the torch layout (w_in [E, F_in, H], w_out [E, H, F])."""
    with precision(dtype), _on(device):
        params = {k: jnp.asarray(v, dtype) for k, v in dict(x=x, w_in=w_in, w_out=w_out, b_in=b_in,
                                                             b_out=b_out).items() if v is not None}
        sizes = jnp.asarray(sizes, jnp.int32)
        y, vjp = jax.vjp(lambda p: gj.grouped_mlp(p["x"], p["w_in"], p["w_out"], sizes, activation=activation,
                                                   b_in=p.get("b_in"), b_out=p.get("b_out"), transpose_rhs=True),
                         params)
        (grads,) = vjp(jnp.asarray(dout, dtype))
        return y, tuple(grads.get(k) for k in ("x", "w_in", "w_out", "b_in", "b_out"))


def softmax_topk_and_grad(logits, k, renormalize, dprobs, dtype, device=None):
    """probs, expert_indices and d logits, from NumPy inputs."""
    with precision(dtype), _on(device):
        (probs, indices), vjp = jax.vjp(lambda x: gj.softmax_topk(x, k, renormalize=renormalize),
                                        jnp.asarray(logits, dtype))
        (dlogits,) = vjp((jnp.asarray(dprobs, probs.dtype), np.zeros(indices.shape, jax.dtypes.float0)))
        return probs, indices, dlogits


def softmax_topk_tangent(logits, k, renormalize, tlogits, dtype, device=None):
    """The forward-mode tangent of softmax_topk's probs (jax.jvp), from NumPy inputs."""
    with precision(dtype), _on(device):
        probs = lambda x: gj.softmax_topk(x, k, renormalize=renormalize)[0]  # noqa: E731
        return jax.jvp(probs, (jnp.asarray(logits, dtype),), (jnp.asarray(tlogits, dtype),))[1]


def shape_only(fn, *specs):
    """fn traced on arrays that have only a shape and a dtype (nothing is allocated)."""
    return jax.eval_shape(fn, *(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs))


permute, unpermute, softmax_topk = gj.permute, gj.unpermute, gj.softmax_topk


def mlp_with_activation(name):
    x = jnp.ones((4, 8))
    return gj.grouped_mlp(x, jnp.ones((2, 8, 6)), jnp.ones((2, 6, 8)), jnp.asarray([2, 2]), activation=name)


# ---- FP8 -----------------------------------------------------------------------------

FP8_NAMES = _contract.FP8_JAX_NAMES


def quantize_fp8(x, recipe, *, dtype="float8_e4m3fn", power_of_two=False):
    return gj.quantize_fp8(x, recipe, dtype=jnp.dtype(dtype), power_of_two=power_of_two)


def quantize_fp8_grouped(x, sizes, recipe, *, num_groups=None, offset=None, dtype="float8_e4m3fn",
                         power_of_two=False):
    return gj.quantize_fp8_grouped(x, sizes, recipe, num_groups=num_groups, group_offset=offset,
                                   dtype=jnp.dtype(dtype), power_of_two=power_of_two)


def scaled_matmul(lhs, rhs, sizes, lhs_scale, rhs_scale, recipe, *, bias=None, offset=None, out_dtype=None):
    return gj.scaled_grouped_matmul(lhs, rhs, sizes, lhs_scale, rhs_scale, recipe=recipe, bias=bias,
                                    preferred_element_type=out_dtype, group_offset=offset)


def scaled_wgrad(lhs, rhs, sizes, lhs_scale, rhs_scale, recipe, *, num_groups=None, offset=None, out_dtype=None,
                 accumulate_into=None):
    return gj.scaled_grouped_matmul_wgrad(lhs, rhs, sizes, lhs_scale, rhs_scale, recipe=recipe,
                                          num_groups=num_groups, group_offset=offset,
                                          preferred_element_type=out_dtype, accumulate_into=accumulate_into)


def fp8_linear_and_grads(x, weight, sizes, bias, dout, recipe, dtype, device=None):
    """y and the gradients of x, weight and bias (None without bias) of one grouped linear
    layer in FP8, as grouped_mlp(fp8=recipe) runs each of its layers (weight [G, N, K])."""
    from groupgemm.jax_ext import fp8_recipe

    with precision(dtype), _on(device):
        params = {"x": jnp.asarray(x, dtype), "w": jnp.asarray(weight, dtype)}
        if bias is not None:
            params["b"] = jnp.asarray(bias, dtype)
        sizes = jnp.asarray(sizes, jnp.int32)
        y, vjp = jax.vjp(lambda p: fp8_recipe.checked_fp8_grouped_matmul(
            p["x"], p["w"], sizes, bias=p.get("b"), transpose_rhs=True, group_offset=None, recipe=recipe,
            fn="grouped_mlp"), params)
        (grads,) = vjp(jnp.asarray(dout, dtype))
        return y, (grads["x"], grads["w"], grads.get("b"))
