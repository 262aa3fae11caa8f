"""The raw calls of the expert layer for JAX: token permute / unpermute, the activation
and the router's softmax top-k, and their derivatives, as XLA FFI calls (targets
registered by raw.py); expert_primitives.py makes them differentiable primitives.

Arguments arrive checked (expert.py); the core re-checks what it can see.
"""

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


def _unpermute_backward_workspace(num_slots, want_dpermuted):
    """The CUDA row sort's scratch (for dpermuted only), an extra XLA output like permute's."""
    cuda = _core.cuda_compiled() and want_dpermuted
    nbytes = _core.unpermute_backward_workspace_bytes(_core.Device.cuda, num_slots) if cuda else 0
    return jax.ShapeDtypeStruct((nbytes,), jnp.uint8)


def unpermute_backward(dout, permuted, row_map, probs, *, num_rows, dprobs_dtype=None, want_dpermuted=True):
    """(dpermuted [R, H] or None, dprobs [T, k] or None): dpermuted when want_dpermuted
    (weighted by probs, or 1 without), dprobs when dprobs_dtype is given (from permuted,
    which only dprobs reads: None otherwise)."""
    t, k = row_map.shape
    want_dprobs = dprobs_dtype is not None
    placeholder = jnp.zeros((0,), dout.dtype)
    call = jax.ffi.ffi_call(
        "groupgemm_unpermute_backward",
        (jax.ShapeDtypeStruct((num_rows, dout.shape[1]) if want_dpermuted else (0,), dout.dtype),
         jax.ShapeDtypeStruct((t, k) if want_dprobs else (0,), dprobs_dtype or dout.dtype),
         _unpermute_backward_workspace(t * k, want_dpermuted)),
        vmap_method="sequential",
    )
    dpermuted, dprobs, _ = call(dout, placeholder if permuted is None else permuted, row_map,
                                placeholder if probs is None else probs, has_probs=np.bool_(probs is not None),
                                has_dpermuted=np.bool_(want_dpermuted), has_dprobs=np.bool_(want_dprobs))
    axes = varying_axes(dout, permuted, row_map, probs)
    return (mark_varying(dpermuted, axes) if want_dpermuted else None,
            mark_varying(dprobs, axes) if want_dprobs else None)


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


def softmax_topk_tangent(logits, expert_indices, tlogits, *, renormalize):
    probs_dtype = jnp.float64 if logits.dtype == jnp.float64 else jnp.float32
    call = jax.ffi.ffi_call("groupgemm_softmax_topk_tangent",
                            jax.ShapeDtypeStruct(expert_indices.shape, probs_dtype), vmap_method="sequential")
    return _varying(call(logits, expert_indices, tlogits, renormalize=np.bool_(renormalize)), logits, tlogits)
