"""The raw calls of the expert layer for JAX: token permute / unpermute, the activation
and the router's softmax top-k, as XLA FFI calls (targets registered by raw.py), each
partitioned by its layout (partitioning.py), with their custom VJPs.

Arguments arrive checked (expert.py); the core re-checks what it can see.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _contract as contract
from groupgemm import _core
from groupgemm.jax_ext.partitioning import Layout, partitioned
from groupgemm.jax_ext.raw import mark_varying, varying_axes


def _permute_workspace(num_slots, num_experts):
    """The CUDA counting sort's scratch, an extra XLA output like the GEMMs' workspace."""
    nbytes = _core.permute_workspace_bytes(_core.Device.cuda, num_slots, num_experts) if _core.cuda_compiled() else 0
    return jax.ShapeDtypeStruct((nbytes,), jnp.uint8)


def _varying(value, *operands):
    return mark_varying(value, varying_axes(*operands))


# tokens [T, H], expert_indices [T, k] -> permuted [T*k, H], group_sizes [E], row_map [T, k]: the rows
# come in expert order over all tokens, so only H splits.
@partitioned(Layout(("t h", "t k"), ("r h", "e", "t k"), replicated=("t", "k", "r", "e")))
def permute_call(tokens, expert_indices, *, num_experts):
    t, k = expert_indices.shape
    call = jax.ffi.ffi_call(
        "groupgemm_permute",
        (jax.ShapeDtypeStruct((t * k, tokens.shape[1]), tokens.dtype), jax.ShapeDtypeStruct((num_experts,), jnp.int32),
         jax.ShapeDtypeStruct((t, k), jnp.int32), _permute_workspace(t * k, num_experts)))
    return call(tokens, expert_indices)[:3]


def permute(tokens, expert_indices, *, num_experts):
    outs = permute_call(tokens, expert_indices, num_experts=num_experts)
    return tuple(_varying(out, tokens, expert_indices) for out in outs)


def _probs_operand(permuted, probs):
    return jnp.zeros((0,), permuted.dtype) if probs is None else probs


# permuted [R, H], row_map [T, k], probs [T, k] -> [T, H]: a device's tokens read any rows.
@partitioned(Layout(("r h", "t k", "t k"), ("t h",), replicated=("r", "k")))
def unpermute_call(permuted, row_map, probs=None):
    call = jax.ffi.ffi_call("groupgemm_unpermute",
                            jax.ShapeDtypeStruct((row_map.shape[0], permuted.shape[1]), permuted.dtype))
    return (call(permuted, row_map, _probs_operand(permuted, probs), has_probs=np.bool_(probs is not None)),)


def unpermute(permuted, row_map, probs):
    out, = unpermute_call(*(permuted, row_map) + (() if probs is None else (probs,)))
    return _varying(out, permuted, row_map, probs)


def _unpermute_backward_layout(*, num_operands):
    # dout [T, H], permuted [R, H], row_map [T, k], probs [T, k] -> dpermuted [R, H], dprobs [T, k]: a
    # device's tokens scatter into their rows (every other row an exact zero), summed over the devices.
    return Layout(("t h", "r h", "t k", "t k"), ("r h", "t k")[:num_operands - 2], summed=("t",),
                  replicated=("r", "k"))


@partitioned(_unpermute_backward_layout)
def unpermute_backward_call(dout, permuted, row_map, probs=None):
    dprobs_shape = (0,) if probs is None else probs.shape
    call = jax.ffi.ffi_call(
        "groupgemm_unpermute_backward",
        (jax.ShapeDtypeStruct(permuted.shape, permuted.dtype),
         jax.ShapeDtypeStruct(dprobs_shape, permuted.dtype if probs is None else probs.dtype)))
    dpermuted, dprobs = call(dout, permuted, row_map, _probs_operand(permuted, probs),
                             has_probs=np.bool_(probs is not None))
    return (dpermuted,) if probs is None else (dpermuted, dprobs)


def unpermute_backward(dout, permuted, row_map, probs):
    """(dpermuted, dprobs); dprobs is None without probs."""
    outs = unpermute_backward_call(*(dout, permuted, row_map) + (() if probs is None else (probs,)))
    axes = varying_axes(dout, permuted, row_map, probs)
    return mark_varying(outs[0], axes), None if probs is None else mark_varying(outs[1], axes)


def _activation_layout(*, kind, num_operands, **_):
    # h [M, F_in] (and dout [M, F]) -> [M, F]; swiglu pairs column j with column F + j, so its
    # columns stay whole; the other activations take each column by itself.
    if kind == contract.activation_kind("swiglu", "activation"):
        return Layout(("m w", "m f")[-num_operands:], ("m w",) if num_operands == 1 else ("m f",),
                      replicated=("f", "w"))
    return Layout(("m f",) * num_operands, ("m f",), local_sizes=(("width", "f"),) if num_operands == 1 else ())


@partitioned(_activation_layout)
def activation_call(h, *, kind, width):
    call = jax.ffi.ffi_call("groupgemm_activation", jax.ShapeDtypeStruct((h.shape[0], width), h.dtype))
    return (call(h, kind=np.int32(kind)),)


def activation(h, *, kind, width):
    return _varying(activation_call(h, kind=kind, width=width)[0], h)


@partitioned(_activation_layout)
def activation_backward_call(dout, h, *, kind):
    call = jax.ffi.ffi_call("groupgemm_activation_backward", jax.ShapeDtypeStruct(h.shape, h.dtype))
    return (call(dout, h, kind=np.int32(kind)),)


def activation_backward(dout, h, *, kind):
    return _varying(activation_backward_call(dout, h, kind=kind)[0], dout, h)


# logits [T, E] -> probs [T, k], expert_indices [T, k]: each token on its own.
@partitioned(Layout(("t e",), ("t k", "t k"), replicated=("e", "k")))
def softmax_topk_call(logits, *, k, probs_dtype, renormalize):
    t = logits.shape[0]
    call = jax.ffi.ffi_call("groupgemm_softmax_topk",
                            (jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), probs_dtype)))
    indices, probs = call(logits, renormalize=np.bool_(renormalize))
    return probs, indices


def softmax_topk(logits, *, k, probs_dtype, renormalize):
    probs, indices = softmax_topk_call(logits, k=k, probs_dtype=np.dtype(probs_dtype), renormalize=renormalize)
    return _varying(probs, logits), _varying(indices, logits)


@partitioned(Layout(("t e", "t k", "t k"), ("t e",), replicated=("e", "k")))
def softmax_topk_backward_call(logits, expert_indices, dprobs, *, renormalize):
    call = jax.ffi.ffi_call("groupgemm_softmax_topk_backward", jax.ShapeDtypeStruct(logits.shape, logits.dtype))
    return (call(logits, expert_indices, dprobs, renormalize=np.bool_(renormalize)),)


def softmax_topk_backward(logits, expert_indices, dprobs, *, renormalize):
    out, = softmax_topk_backward_call(logits, expert_indices, dprobs, renormalize=renormalize)
    return _varying(out, logits, dprobs)


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
