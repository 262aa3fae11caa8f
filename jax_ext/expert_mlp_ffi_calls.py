"""The FFI calls of the fused expert MLP for JAX (groupgemm/expert_mlp.h): its forward and
its backward, each partitioned by its layout (partitioning.py): tokens split over devices
data-parallel, experts split with group_offset (each device runs its window of experts,
its results a partial sum over them). The hidden and FFN widths stay whole: the
activation sits between the two GEMMs. expert_mlp_primitives.py makes them primitives.

Absent operands (probs, the biases) are left out of a call; a result not wanted is a
size-0 placeholder of a factor of its own. The [T*k, H] scratch rows and the CUDA
workspace are the calls' own outputs, dropped inside them (XLA's temporaries).
"""

import jax
import numpy as np

from groupgemm import _core
from groupgemm.jax_ext.ffi_calls import placeholder, workspace
from groupgemm.jax_ext.partitioning import Layout, partitioned

# The differentiable operands, in the order of every tuple of them (tangents, gradients).
DIFFERENTIABLE = ("tokens", "w_in", "w_out", "probs", "b_in", "b_out")


def _weights(transpose_rhs):
    """w_in and w_out's factors: [E, H, F_in] and [E, F, H], or [E, F_in, H] and [E, H, F]."""
    return ("e w h", "e h f") if transpose_rhs else ("e h w", "e f h")


def _forward_layout(*, transpose_rhs, has_probs, has_b_in, has_b_out, want_h, **_):
    # tokens [T, H], expert_indices [T, k], w_in, w_out, group_offset, probs [T, k], b_in [E, F_in],
    # b_out [E, H] -> out [T, H], h [T, k, F_in]
    operands = ("t h", "t k", *_weights(transpose_rhs), "") + ("t k",) * has_probs + ("e w",) * has_b_in \
        + ("e h",) * has_b_out
    return Layout(operands, ("t h", "t k w" if want_h else "no_h"), groups="e", summed=("e",),
                  replicated=("h", "w", "f", "k"), offset=4)


def _optional(present, flags):
    """The optional trailing operands, None where absent."""
    values = iter(present)
    return [next(values) if flag else None for flag in flags]


@partitioned(_forward_layout)
def expert_mlp(tokens, expert_indices, w_in, w_out, group_offset, *optional, kind, transpose_rhs, has_probs,
               has_b_in, has_b_out, want_h):
    """``(out [T, H], h [T, k, F_in])``, h a placeholder unless ``want_h``."""
    probs, b_in, b_out = _optional(optional, (has_probs, has_b_in, has_b_out))
    t, k = expert_indices.shape
    f_in = w_in.shape[1] if transpose_rhs else w_in.shape[2]
    dtype, none = tokens.dtype, placeholder(tokens.dtype)
    call = jax.ffi.ffi_call("groupgemm_expert_mlp", (
        jax.ShapeDtypeStruct((t, tokens.shape[1]), dtype),
        jax.ShapeDtypeStruct((t, k, f_in) if want_h else (0,), dtype),
        jax.ShapeDtypeStruct((t * k, tokens.shape[1]), dtype),  # the expert outputs' scratch rows
        workspace(_core.expert_mlp_workspace_bytes, t * k, w_in.shape[0], tokens.shape[1], f_in, kind,
                  dtype.itemsize, False)))
    out, h, _, _ = call(tokens, expert_indices, none if probs is None else probs, w_in, w_out,
                        none if b_in is None else b_in, none if b_out is None else b_out, group_offset,
                        kind=np.int64(kind), transpose_rhs=np.bool_(transpose_rhs))
    return out, h


def _backward_layout(*, transpose_rhs, has_probs, has_b_out, want, **_):
    # dout [T, H], tokens [T, H], expert_indices [T, k], w_in, w_out, group_offset, h [T, k, F_in], probs, b_out
    # -> dtokens, dw_in, dw_out, dprobs, db_in, db_out: each a partial sum over the factors it lacks (the
    # tokens, the experts)
    w_in, w_out = _weights(transpose_rhs)
    operands = ("t h", "t h", "t k", w_in, w_out, "", "t k w") + ("t k",) * has_probs + ("e h",) * has_b_out
    results = tuple(dims if wanted else f"no_{name}" for dims, wanted, name in
                    zip(("t h", w_in, w_out, "t k", "e w", "e h"), want, DIFFERENTIABLE))
    return Layout(operands, results, groups="e", summed=("t", "e"), replicated=("h", "w", "f", "k"), offset=5)


@partitioned(_backward_layout)
def expert_mlp_backward(dout, tokens, expert_indices, w_in, w_out, group_offset, h, *optional, kind, transpose_rhs,
                        has_probs, has_b_out, want, probs_dtype):
    """The gradients of ``DIFFERENTIABLE`` for dout, each a size-0 placeholder unless
    ``want`` says so (b_in's from h's)."""
    probs, b_out = _optional(optional, (has_probs, has_b_out))
    t, k = expert_indices.shape
    e, f_in = w_in.shape[0], w_in.shape[1] if transpose_rhs else w_in.shape[2]
    dtype, none = tokens.dtype, placeholder(tokens.dtype)
    shapes = (tokens.shape, w_in.shape, w_out.shape, (t, k), (e, f_in), (e, tokens.shape[1]))
    dtypes = (dtype, dtype, dtype, probs_dtype, dtype, dtype)
    call = jax.ffi.ffi_call("groupgemm_expert_mlp_backward", (
        *(jax.ShapeDtypeStruct(shape if wanted else (0,), d) for shape, d, wanted in zip(shapes, dtypes, want)),
        jax.ShapeDtypeStruct((t * k, tokens.shape[1]) if want[0] else (0,), dtype),  # the token rows' scratch
        workspace(_core.expert_mlp_workspace_bytes, t * k, e, tokens.shape[1], f_in, kind, dtype.itemsize, True)))
    results = call(dout, tokens, expert_indices, none if probs is None else probs, w_in, w_out,
                   none if b_out is None else b_out, group_offset, h, kind=np.int64(kind),
                   transpose_rhs=np.bool_(transpose_rhs))
    return tuple(results[:6])
