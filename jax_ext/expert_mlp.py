"""groupgemm for JAX, the fused expert MLP: permute, the grouped MLP and unpermute in one op
(expert_mlp_primitives.py), checked at trace time (rules from groupgemm._contract). The
routing stays on the device: one jit compile serves every routing."""

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _contract as contract
from groupgemm.jax_ext.arguments import (
    as_array,
    as_arrays,
    dtype_name,
    index_array,
    index_input,
    same_varying_axes,
    shape_and_dtype,
)
from groupgemm.jax_ext.expert import grouped_mlp, permute, unpermute
from groupgemm.jax_ext.expert_mlp_primitives import expert_mlp_p, window_ids
from groupgemm.jax_ext.primitives import placeholder


def _group_offset(group_offset, num_local, fn):
    """group_offset as a checked array: int32 0 when absent, a one-element integer array
    (which may be traced), or a Python or NumPy integer (contract.static_window_offset; past
    int32 only with jax_enable_x64, as the ids it can name)."""
    if group_offset is None:
        return jnp.zeros((), jnp.int32)
    if not isinstance(group_offset, (jax.Array, np.ndarray)):
        largest, why = (contract.INT64_MAX, "") if jax.config.jax_enable_x64 else \
            (contract.INT32_MAX, ", the largest id JAX without jax_enable_x64 holds; enable x64")
        group_offset = contract.static_window_offset(group_offset, num_local, largest, fn, why)
        group_offset = np.asarray(group_offset, np.int32 if group_offset <= contract.INT32_MAX else np.int64)
    group_offset = index_input(group_offset, "group_offset", fn)
    contract.check_group_offset_array(group_offset.shape, dtype_name(group_offset.dtype), fn)
    return group_offset.reshape(())


def _routing(expert_indices, group_offset, num_local, fn):
    """expert_indices and group_offset as the core's operands. JAX without jax_enable_x64
    holds uint32 ids and offsets past int32 in no signed type (index_array would drop such
    ids, and make such an offset a window of none), so uint32 ids are windowed here, exactly,
    by the offset as given (window_ids), and the core gets local ids with offset 0."""
    offset = _group_offset(group_offset, num_local, fn)
    if expert_indices.dtype == jnp.uint32 and not jax.config.jax_enable_x64:
        exact = offset if offset.dtype == jnp.uint32 else index_array(offset)
        return window_ids(expert_indices, exact, num_local), jnp.zeros((), jnp.int32)
    return index_array(expert_indices, role="id"), index_array(offset, role="id_window")


def expert_mlp(tokens, expert_indices, probs, w_in, w_out, *, activation="swiglu", b_in=None, b_out=None,
               group_offset=None, transpose_rhs=False, fp8=None):
    """The expert layer fused: ``out[t] = sum over j of probs[t, j] * mlp_e(tokens[t])``,
    ``e = expert_indices[t, j]``, ``mlp_e = fc2(act(fc1(.)))`` (``[T, H]``).

    The same result as ``unpermute(grouped_mlp(permute(tokens, ...)), row_map, probs)``,
    without its copies: the token rows are read through the routing inside the GEMMs, the
    sum over a token's slots runs in slot order in float32 (float64), and a gradient keeps
    only fc1's output per slot (``[T, k, F_in]``), recomputing the activation and taking
    ``probs``' gradient from ``dout @ w_out^T`` instead of a saved expert output.

    ``expert_indices [T, k]``: global expert ids; ``w_in`` / ``w_out`` hold experts
    ``[group_offset, group_offset + E)`` (``group_offset`` an int or a one-element integer
    array, which may be traced; default 0); a slot whose id is negative or outside that
    window adds nothing. ``probs [T, k]`` (tokens' dtype or float32), or None for weight 1.
    ``activation``, ``b_in``, ``b_out`` and ``transpose_rhs`` as grouped_mlp's. ``fp8`` is
    not fused yet: pass it to grouped_mlp in the composition. Differentiable in tokens,
    probs, the weights and the biases to any order, in forward and reverse mode; idle
    experts get exact-zero gradients.
    """
    fn = "expert_mlp"
    if fp8 is not None:
        raise NotImplementedError(f"{fn}: fp8 is not fused into the expert MLP yet; run permute, "
                                  "grouped_mlp(fp8=...) and unpermute")
    kind = contract.activation_kind(activation, fn)
    transpose_rhs = contract.static_flag(transpose_rhs, "transpose_rhs", fn)
    tokens, w_in, w_out = as_arrays(fn, tokens=tokens, w_in=w_in, w_out=w_out)
    expert_indices = index_input(expert_indices, "expert_indices", fn)
    probs, b_in, b_out = as_arrays(fn, optional=True, probs=probs, b_in=b_in, b_out=b_out)
    described = lambda x: None if x is None else shape_and_dtype(x)  # noqa: E731
    contract.expert_mlp(fn, shape_and_dtype(tokens), shape_and_dtype(expert_indices), described(probs),
                        shape_and_dtype(w_in), shape_and_dtype(w_out), described(b_in), described(b_out), activation,
                        transpose_rhs)
    expert_indices, group_offset = _routing(expert_indices, group_offset, w_in.shape[0], fn)
    tokens, w_in, w_out, probs, b_in, b_out = same_varying_axes((tokens, w_in, w_out, probs, b_in, b_out),
                                                                (expert_indices, group_offset))
    none = placeholder(tokens.dtype)
    out, _ = expert_mlp_p.bind(tokens, expert_indices, w_in, w_out, group_offset,
                               *(none if x is None else x for x in (probs, b_in, b_out)), kind=kind,
                               transpose_rhs=transpose_rhs, has_probs=probs is not None,
                               has_b_in=b_in is not None, has_b_out=b_out is not None, want_h=False)
    return out


def composed_expert_mlp(tokens, expert_indices, probs, w_in, w_out, *, activation="swiglu", b_in=None, b_out=None,
                        group_offset=None, transpose_rhs=False, fp8=None):
    """expert_mlp as the composition computes it (permute, grouped_mlp, unpermute), the same
    arguments and meaning: what the layers run with ``fused=False``, and under FP8."""
    fn = "expert_mlp"
    tokens, w_in = as_array(tokens, "tokens", fn), as_array(w_in, "w_in", fn)
    expert_indices = index_input(expert_indices, "expert_indices", fn)
    probs = as_array(probs, "probs", fn, optional=True)
    contract.routed_tokens(fn, shape_and_dtype(tokens), shape_and_dtype(expert_indices),
                           None if probs is None else shape_and_dtype(probs))
    local = window_ids(*_routing(expert_indices, group_offset, w_in.shape[0], fn), w_in.shape[0])
    rows, group_sizes, row_map = permute(tokens, local, w_in.shape[0])
    y = grouped_mlp(rows, w_in, w_out, group_sizes, activation=activation, b_in=b_in, b_out=b_out,
                    transpose_rhs=transpose_rhs, fp8=fp8)
    return unpermute(y, row_map, probs)


def fused_by_default():
    """Whether the layers run the fused op when not told (``fused=None``): on the CPU, where it
    is measured faster than the composition (docs/benchmarks.md); elsewhere the composition
    until a GPU run validates the fused kernels."""
    return jax.default_backend() == "cpu"


def runs_fused(fused, fp8, fn):
    """Whether a layer given ``fused`` (None, True or False) runs the fused op: as told, or
    when not told where it is the default and never under ``fp8``, which it does not do."""
    if contract.check_fused(fused, fp8, fn) is not None:
        return fused
    return fp8 is None and fused_by_default()
