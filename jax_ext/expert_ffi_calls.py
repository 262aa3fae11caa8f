"""The FFI calls of the expert layer for JAX: token permute / unpermute, the activation
and the router's softmax top-k, and their derivatives, as XLAn FFI calls (targets
registered by ffi_calls.py), each partitioned by its layout (partitioning.py);
expert_primitives.py makes them differentiable primitives.

Arguments arrive checked (expert.py); the core re-checks what it can see.
"""

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _contract as contract
from groupgemm import _core
from groupgemm.jax_ext.ffi_calls import placeholder, workspace
from groupgemm.jax_ext.partitioning import Layout, partitioned


# tokens [T, H], expert_indices [T, k] -> permuted [T*k, H], group_sizes [E], row_map [T, k]: the rows
# come in expert order over all tokens, so only H splits.
@partitioned(Layout(("t h", "t k"), ("r h", "e", "t k"), replicated=("t", "k", "r", "e")))
def permute(tokens, expert_indices, *, num_experts):
    t, k = expert_indices.shape
    call = jax.ffi.ffi_call(
        "groupgemm_permute",
        (jax.ShapeDtypeStruct((t * k, tokens.shape[1]), tokens.dtype), jax.ShapeDtypeStruct((num_experts,), jnp.int32),
         jax.ShapeDtypeStruct((t, k), jnp.int32), workspace(_core.permute_workspace_bytes, t * k, num_experts)))
    return call(tokens, expert_indices)[:3]


# permuted [R, H], row_map [T, k], probs [T, k] -> [T, H]: a device's tokens read any rows.
@partitioned(Layout(("r h", "t k", "t k"), ("t h",), replicated=("r", "k")))
def unpermute(permuted, row_map, probs=None):
    call = jax.ffi.ffi_call("groupgemm_unpermute",
                            jax.ShapeDtypeStruct((row_map.shape[0], permuted.shape[1]), permuted.dtype))
    return (call(permuted, row_map, placeholder(permuted.dtype) if probs is None else probs),)


# dout [T, H], row_map [T, k], probs [T, k] -> dpermuted [R, H], unpermute's backward for dpermuted: a
# device's tokens scatter into their rows (every other row an exact zero), summed over the devices.
@partitioned(Layout(("t h", "t k", "t k"), ("r h",), summed=("t",), replicated=("r", "k")))
def unpermute_scatter(dout, row_map, probs=None, *, num_rows):
    """``out[r] = sum over the slots s = (t, j) naming row r, in slot order, of probs[s] * dout[t]``
    (probs 1 when absent)."""
    t, k = row_map.shape
    call = jax.ffi.ffi_call(
        "groupgemm_unpermute_backward",
        (jax.ShapeDtypeStruct((num_rows, dout.shape[1]), dout.dtype), jax.ShapeDtypeStruct((0,), dout.dtype),
         workspace(_core.unpermute_backward_workspace_bytes, t * k)))
    none = placeholder(dout.dtype)  # permuted: only dprobs reads it
    dpermuted, _, _ = call(dout, none, row_map, none if probs is None else probs)
    return (dpermuted,)


# permuted [R, H], dout [T, H], row_map [T, k] -> dprobs [T, k], unpermute's backward for dprobs: a
# device's tokens read any rows; over shards of H each dot is a partial sum.
@partitioned(Layout(("r h", "t h", "t k"), ("t k",), summed=("h",), replicated=("r", "k"),
                    dtypes=((0, "dots_dtype"),)))
def unpermute_slot_dots(permuted, dout, row_map, *, dots_dtype):
    """``out[t, j] = dot(permuted[row_map[t, j]], dout[t])``, 0 where row_map names no row."""
    call = jax.ffi.ffi_call(
        "groupgemm_unpermute_backward",
        (jax.ShapeDtypeStruct((0,), dout.dtype), jax.ShapeDtypeStruct(row_map.shape, dots_dtype),
         jax.ShapeDtypeStruct((0,), jnp.uint8)))  # the row sort's scratch serves dpermuted alone
    _, dprobs, _ = call(dout, permuted, row_map, placeholder(dout.dtype))
    return (dprobs,)


def _activation_layout(*, kind, num_operands, **_):
    # h [M, F_in] (and dout [M, F]) -> [M, F]; swiglu pairs column j with column F + j, so its
    # columns stay whole; the other activations take each column by itself.
    if kind == contract.activation_kind("swiglu", "activation"):
        return Layout(("m w", "m f")[-num_operands:], ("m w",) if num_operands == 1 else ("m f",),
                      replicated=("f", "w"))
    return Layout(("m f",) * num_operands, ("m f",), local_sizes=(("width", "f"),) if num_operands == 1 else ())


@partitioned(_activation_layout)
def activation(h, *, kind, width):
    call = jax.ffi.ffi_call("groupgemm_activation", jax.ShapeDtypeStruct((h.shape[0], width), h.dtype))
    return (call(h, kind=np.int64(kind)),)


@partitioned(_activation_layout)
def activation_backward(dout, h, *, kind):
    call = jax.ffi.ffi_call("groupgemm_activation_backward", jax.ShapeDtypeStruct(h.shape, h.dtype))
    return (call(dout, h, kind=np.int64(kind)),)


# logits [T, E] -> probs [T, k], expert_indices [T, k]: each token on its own.
@partitioned(Layout(("t e",), ("t k", "t k"), replicated=("e", "k")))
def softmax_topk(logits, *, k, probs_dtype, renormalize):
    t = logits.shape[0]
    call = jax.ffi.ffi_call("groupgemm_softmax_topk",
                            (jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), probs_dtype)))
    indices, probs = call(logits, renormalize=np.bool_(renormalize))
    return probs, indices


# logits [T, E], expert_indices [T, k], dprobs [T, k] -> dlogits [T, E]: each token on its own.
@partitioned(Layout(("t e", "t k", "t k"), ("t e",), replicated=("e", "k")))
def softmax_topk_backward(logits, expert_indices, dprobs, *, renormalize):
    call = jax.ffi.ffi_call("groupgemm_softmax_topk_backward", jax.ShapeDtypeStruct(logits.shape, logits.dtype))
    return (call(logits, expert_indices, dprobs, renormalize=np.bool_(renormalize)),)


# logits [T, E], expert_indices [T, k], tlogits [T, E] -> tprobs [T, k], the router's forward-mode
# derivative: each token on its own.
@partitioned(Layout(("t e", "t k", "t e"), ("t k",), replicated=("e", "k")))
def softmax_topk_tangent(logits, expert_indices, tlogits, *, renormalize):
    probs_dtype = np.dtype(contract.accumulate_dtype(np.dtype(logits.dtype).name))
    call = jax.ffi.ffi_call("groupgemm_softmax_topk_tangent", jax.ShapeDtypeStruct(expert_indices.shape, probs_dtype))
    return (call(logits, expert_indices, tlogits, renormalize=np.bool_(renormalize)),)
