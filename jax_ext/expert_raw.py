"""The raw calls of the expert layer for JAX: token permute / unpermute, the activation
and the router's softmax top-k, as XLA FFI calls (targets registered by raw.py), with their custom VJPs.

Arguments arrive checked (expert.py); the core re-checks what it can see.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _core
from groupgemm.jax_ext.raw import mark_varying, varying_axes


def _permute_workspace(num_slots, num_experts):
    """The CUDA counting sort's scratch, an extra XLA output like the GEMMs' workspace."""
    nbytes = _core.permute_workspace_bytes(_core.Device.cuda, num_slots, num_experts) if _core.cuda_compiled() else 0
    return jax.ShapeDtypeStruct((nbytes,), jnp.uint8)


def _varying(value, *operands):
    return mark_varying(value, varying_axes(*operands))


def permute(tokens, expert_indices, *, num_experts):
    t, k = expert_indices.shape
    call = jax.ffi.ffi_call(
        "groupgemm_permute",
        (jax.ShapeDtypeStruct((t * k, tokens.shape[1]), tokens.dtype), jax.ShapeDtypeStruct((num_experts,), jnp.int32),
         jax.ShapeDtypeStruct((t, k), jnp.int32), _permute_workspace(t * k, num_experts)),
        vmap_method="sequential",
    )
    permuted, group_sizes, row_map, _ = call(tokens, expert_indices)
    return tuple(_varying(out, tokens, expert_indices) for out in (permuted, group_sizes, row_map))


def unpermute(permuted, row_map, probs):
    call = jax.ffi.ffi_call("groupgemm_unpermute",
                            jax.ShapeDtypeStruct((row_map.shape[0], permuted.shape[1]), permuted.dtype),
                            vmap_method="sequential")
    out = call(permuted, row_map, jnp.zeros((0,), permuted.dtype) if probs is None else probs,
               has_probs=np.bool_(probs is not None))
    return _varying(out, permuted, row_map, probs)


def unpermute_backward(dout, permuted, row_map, probs):
    """(dpermuted, dprobs); dprobs is None without probs."""
    dprobs_shape = (0,) if probs is None else probs.shape
    call = jax.ffi.ffi_call(
        "groupgemm_unpermute_backward",
        (jax.ShapeDtypeStruct(permuted.shape, permuted.dtype),
         jax.ShapeDtypeStruct(dprobs_shape, permuted.dtype if probs is None else probs.dtype)),
        vmap_method="sequential",
    )
    dpermuted, dprobs = call(dout, permuted, row_map, jnp.zeros((0,), permuted.dtype) if probs is None else probs,
                             has_probs=np.bool_(probs is not None))
    axes = varying_axes(dout, permuted, row_map, probs)
    return mark_varying(dpermuted, axes), None if probs is None else mark_varying(dprobs, axes)


def activation(h, *, kind, width):
    call = jax.ffi.ffi_call("groupgemm_activation", jax.ShapeDtypeStruct((h.shape[0], width), h.dtype),
                            vmap_method="sequential")
    return _varying(call(h, kind=np.int32(kind)), h)


def activation_backward(dout, h, *, kind):
    call = jax.ffi.ffi_call("groupgemm_activation_backward", jax.ShapeDtypeStruct(h.shape, h.dtype),
                            vmap_method="sequential")
    return _varying(call(dout, h, kind=np.int32(kind)), dout, h)


def softmax_topk(logits, *, k, probs_dtype, renormalize):
    t = logits.shape[0]
    call = jax.ffi.ffi_call("groupgemm_softmax_topk",
                            (jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), probs_dtype)),
                            vmap_method="sequential")
    indices, probs = call(logits, renormalize=np.bool_(renormalize))
    return _varying(probs, logits), _varying(indices, logits)


def softmax_topk_backward(logits, expert_indices, dprobs, *, renormalize):
    call = jax.ffi.ffi_call("groupgemm_softmax_topk_backward", jax.ShapeDtypeStruct(logits.shape, logits.dtype),
                            vmap_method="sequential")
    return _varying(call(logits, expert_indices, dprobs, renormalize=np.bool_(renormalize)), logits, dprobs)


# ---- custom VJPs: each backward is another core call ---------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def differentiable_permute(tokens, expert_indices, num_experts):
    return permute(tokens, expert_indices, num_experts=num_experts)


def _permute_fwd(tokens, expert_indices, num_experts):
    outs = differentiable_permute(tokens, expert_indices, num_experts)
    return outs, outs[2]


def _permute_bwd(num_experts, row_map, cotangents):
    # Each token's gradient sums its k rows' gradients in slot order: unpermute without probs.
    dtokens = unpermute(cotangents[0], row_map, None)
    return dtokens, None


differentiable_permute.defvjp(_permute_fwd, _permute_bwd)


@jax.custom_vjp
def differentiable_unpermute(permuted, row_map, probs):
    return unpermute(permuted, row_map, probs)


def _unpermute_fwd(permuted, row_map, probs):
    return unpermute(permuted, row_map, probs), (permuted, row_map, probs)


def _unpermute_bwd(residuals, dout):
    permuted, row_map, probs = residuals
    # The core multiplies operands of one dtype: a wider dout is rounded once.
    dpermuted, dprobs = unpermute_backward(dout.astype(permuted.dtype), permuted, row_map, probs)
    return dpermuted, None, dprobs


differentiable_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def differentiable_activation(h, kind, width):
    return activation(h, kind=kind, width=width)


def _activation_fwd(h, kind, width):
    return activation(h, kind=kind, width=width), h


def _activation_bwd(kind, width, h, dout):
    return (activation_backward(dout.astype(h.dtype), h, kind=kind),)


differentiable_activation.defvjp(_activation_fwd, _activation_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def differentiable_softmax_topk(logits, k, probs_dtype, renormalize):
    return softmax_topk(logits, k=k, probs_dtype=probs_dtype, renormalize=renormalize)


def _softmax_topk_fwd(logits, k, probs_dtype, renormalize):
    probs, indices = softmax_topk(logits, k=k, probs_dtype=probs_dtype, renormalize=renormalize)
    return (probs, indices), (logits, indices)


def _softmax_topk_bwd(k, probs_dtype, renormalize, residuals, cotangents):
    logits, indices = residuals
    dprobs = cotangents[0].astype(probs_dtype)
    return (softmax_topk_backward(logits, indices, dprobs, renormalize=renormalize),)


differentiable_softmax_topk.defvjp(_softmax_topk_fwd, _softmax_topk_bwd)
