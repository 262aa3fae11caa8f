"""groupgemm for JAX, the expert layer: the router's softmax top-k, token permute /
unpermute and the grouped expert MLP, checked at trace time (rules from groupgemm._contract). Indices, group sizes and
row maps stay on the device: one jit compile serves every routing."""

import functools

import jax.numpy as jnp

from groupgemm import _contract as contract
from groupgemm.jax_ext import fp8_recipe
from groupgemm.jax_ext.arguments import (
    as_array,
    as_arrays,
    dtype_name,
    index_array,
    index_input,
    index_operands,
    same_varying_axes,
    shape_and_dtype,
)
from groupgemm.jax_ext.expert_primitives import activation_p, permute_p, router_p, unpermute_p
from groupgemm.jax_ext.functional import grouped_matmul
from groupgemm.jax_ext.primitives import placeholder


def softmax_topk(logits, k, *, renormalize=True):
    """The router: each token's top-k experts and their weights, ``(probs [T, k], expert_indices [T, k] int32)``.

    ``logits [T, E]``. The choices are the k largest logits, larger first and, between equal
    logits, the lower expert first; a logit of ``-inf`` (a masked expert) or NaN is never
    chosen (a NaN logit counts as ``-inf``, in both modes), and a slot left without a choice
    is dropped (index -1, probability 0, which permute treats as a dropped slot). ``probs``
    are the softmax over the chosen logits (``renormalize=True``, Mixtral) or the full
    softmax's values at the chosen experts; float32 (float64 for float64 logits), computed
    in the core: the same bits in JAX and PyTorch. Differentiable in ``logits`` to any
    order, in forward and reverse mode, with the choices held fixed.
    """
    fn = "softmax_topk"
    logits = as_array(logits, "logits", fn)
    if logits.ndim == 2 and not contract.is_static_int(logits.shape[1]):  # jax.export's symbolic dimension
        raise ValueError(f"{fn}: logits has a symbolic number of experts ({logits.shape[1]}), which the top-k "
                         "needs known; export it with a static one")
    k, probs_dtype = contract.softmax_topk(fn, shape_and_dtype(logits), k, renormalize)
    return tuple(router_p.bind(logits, k=k, renormalize=renormalize, probs_dtype=jnp.dtype(probs_dtype)))


def permute(tokens, expert_indices, num_experts):
    """Groups token rows by expert: ``(permuted [T*k, H], group_sizes [E] int32, row_map [T, k] int32)``.

    ``expert_indices [T, k]`` holds each token's top-k experts; a value outside
    ``[0, num_experts)`` is a dropped slot. Rows come in ascending expert order, within
    an expert in ascending ``t*k + j`` order; dropped slots last, as exact-zero rows.
    ``row_map[t, j]`` is the row holding slot ``(t, j)``, or -1 when it is dropped.
    Differentiable in ``tokens`` to any order, in forward and reverse mode (each token's
    gradient sums its k rows' gradients).
    """
    fn = "permute"
    tokens, expert_indices = as_array(tokens, "tokens", fn), index_input(expert_indices, "expert_indices", fn)
    *_, num_experts = contract.permute(fn, shape_and_dtype(tokens), shape_and_dtype(expert_indices), num_experts)
    expert_indices = index_array(expert_indices)
    (tokens,) = same_varying_axes((tokens,), (expert_indices,))
    return tuple(permute_p.bind(tokens, expert_indices, num_experts=num_experts))


def unpermute(permuted, row_map, probs=None):
    """``out[t] = sum over j of probs[t, j] * permuted[row_map[t, j]]`` (``[T, H]``).

    Summed in j order in float32 (float64 for float64) and rounded once to permuted's
    dtype; an entry outside ``[0, R)`` (a dropped slot, ``-1``) adds nothing, a row named
    twice adds twice; ``probs=None`` means 1. Differentiable in ``permuted`` and ``probs``
    to any order, in forward and reverse mode, for any row_map: a row's gradient sums
    every slot that names it, in slot order.
    """
    fn = "unpermute"
    permuted, row_map = as_array(permuted, "permuted", fn), index_input(row_map, "row_map", fn)
    probs = as_array(probs, "probs", fn, optional=True)
    probs_arg = None if probs is None else shape_and_dtype(probs)
    contract.unpermute(fn, shape_and_dtype(permuted), shape_and_dtype(row_map), probs_arg)
    permuted, probs = same_varying_axes((permuted, probs), (row_map,))
    return unpermute_p.bind(permuted, row_map, placeholder(permuted.dtype) if probs is None else probs,
                            has_weights=probs is not None)


def _activate(h, name, fn):
    """The expert MLP's activation of ``h [M, F_in]``, computed in the core (see
    grouped_mlp). Zero rows stay exactly zero."""
    width = contract.activation_width(name, h.shape[1], fn)
    return activation_p.bind(h, kind=contract.activation_kind(name, fn), width=width)


def grouped_mlp(x, w_in, w_out, group_sizes, *, activation="swiglu", b_in=None, b_out=None, group_offset=None,
                transpose_rhs=False, fp8=None):
    """Each expert's MLP on its rows: ``fc2(act(fc1(x)))``, output in x's dtype.

    ``w_in [E, H, F_in]`` and ``w_out [E, F, H]`` (with ``transpose_rhs=True``:
    ``[E, F_in, H]`` and ``[E, H, F]``, the torch layout); ``b_in [E, F_in]``,
    ``b_out [E, H]``; ``group_sizes`` and ``group_offset`` as in grouped_matmul.
    ``activation``: ``"swiglu"`` (``silu(gate) * up``, F_in = 2F, the first F columns the
    gate), ``"gelu"`` (exact erf form), ``"relu"`` or ``"silu"``, computed in the core. Rows owned
    by no local expert come out as exact zeros; every parameter gets a full-shape gradient.
    ``fp8="rowwise"`` or ``"blockwise"`` runs both layers' forward, input-gradient and
    weight-gradient GEMMs in float8 (e4m3) from the float32 or bfloat16 weights and x (the
    recipe of groupgemm/_fp8_recipe.py; blockwise needs H and F_in, F multiples of 128), the
    same calls as PyTorch's GroupedMLP(fp8=...).
    """
    fn = "grouped_mlp"
    x, w_in, w_out = as_arrays(fn, x=x, w_in=w_in, w_out=w_out)
    b_in, b_out = as_arrays(fn, optional=True, b_in=b_in, b_out=b_out)
    contract.activation_kind(activation, fn)
    contract.check_rank(x.shape, 2, "x", "[M, H]", fn)
    described = lambda b: None if b is None else shape_and_dtype(b)  # noqa: E731
    f = contract.grouped_mlp(fn, shape_and_dtype(x), shape_and_dtype(w_in), shape_and_dtype(w_out), activation,
                             contract.static_flag(transpose_rhs, "transpose_rhs", fn), "x", described(b_in),
                             described(b_out))
    contract.fp8_layer(fn, fp8, dtype_name(x.dtype), x.shape[1], f, ("H", "F"))  # before either layer's
    group_sizes, group_offset = index_operands(group_sizes, group_offset, w_in.shape[0], x.shape[0], fn)
    if fp8 is None:
        layer = grouped_matmul
    else:
        layer = functools.partial(fp8_recipe.checked_fp8_grouped_matmul, recipe=fp8, fn=fn)
    h = layer(x, w_in, group_sizes, bias=b_in, transpose_rhs=transpose_rhs, group_offset=group_offset)
    return layer(_activate(h, activation, fn), w_out, group_sizes, bias=b_out, transpose_rhs=transpose_rhs,
                 group_offset=group_offset)
