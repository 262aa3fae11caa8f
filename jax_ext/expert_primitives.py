"""The expert layer's ops as JAX primitives, so that every JAX transformation composes, as
for the grouped GEMMs (primitives.py): jit, vmap, forward and reverse mode to any order.

Token movement: three multilinear maps of (rows, slot weights, per-token values), each
lowered to one core call (expert_ffi_calls.py), each one's transposes the other two:
- ``unpermute_p``: ``out[t] = sum over j of w[t, j] * values[row_map[t, j]]`` (unpermute);
- ``scatter_p``: ``out[r] = sum over the slots s = (t, j) naming row r, in slot order, of
  w[s] * dout[t]`` (unpermute's backward for dpermuted; with weight 1, permute's tangent);
- ``slot_dots_p``: ``out[t, j] = dot(values[row_map[t, j]], dout[t])`` (its dprobs).
``permute_p`` sorts the slots; its tangent is ``scatter_p`` of the tokens' tangent with
weight 1 (permute copies each token to the rows of its slots). A row named twice, or an
entry outside the rows, means the same thing in all four.

The activation and the router: ``activation_p`` and ``router_p`` (softmax top-k), with
their Jacobians as linear primitives, each the other's transpose: ``activation_grad_p``
(``J^T dout``, the core's backward) and the activation's tangent ``J t`` built from it;
``router_grad_p`` (``J^T dprobs``) and ``router_tangent_p`` (``J t``, the core's forward-
mode derivative). So first derivatives in either mode are core calls (the PyTorch
frontend's bits, exact zeros included). The core has no second derivatives: how those
Jacobians change with ``h`` or the logits (second order and up) is differentiated by JAX
from the same formulas written with jax.numpy below.

Each primitive is ``define``d as the grouped GEMMs are (primitives.py): it lowers to its
partitioned FFI call, and its ``batched`` parameter flags the operands that carry a
leading vmapped axis (a tangent has its primal's flag, a result is batched when any
operand is, and a transpose sums the cotangent of an operand without that axis over it).
"""

import math

import jax
import jax.numpy as jnp
from jax.interpreters import ad, mlir

from groupgemm import _contract as contract
from groupgemm.jax_ext import expert_ffi_calls
from groupgemm.jax_ext.partitioning import varying_count
from groupgemm.jax_ext.primitives import (
    aval_of,
    cotangent,
    define,
    is_zero,
    placeholder,
    primitive,
    sum_terms,
    zero_tangent,
)


def _per_entry(fn, batched):
    """``fn``, written for one call's operands, over the batch: the operands ``batched`` flags
    carry a leading vmapped axis (the jax.numpy formulas below)."""
    return jax.vmap(fn, in_axes=tuple(0 if b else None for b in batched)) if any(batched) else fn


def _linear_and_formula_jvp(get_prim, linear, smooth, formula):
    """The jvp of a primitive linear in operand ``linear`` (that term: the primitive on its
    tangent, a core call) and differentiable in operand ``smooth`` through ``formula(*operands,
    **params)``, the primitive written with jax.numpy, which JAX differentiates (second
    derivatives only)."""

    def jvp(primals, tangents, *, batched, **params):
        prim = get_prim()
        out = prim.bind(*primals, batched=batched, **params)
        terms = []
        if not is_zero(tangents[linear]):
            substituted = (*primals[:linear], tangents[linear], *primals[linear + 1:])
            terms.append(prim.bind(*substituted, batched=batched, **params))
        if not is_zero(tangents[smooth]):
            def along(*operands):  # the primals, then the smooth operand's tangent
                *operands, t = operands
                at = lambda x: formula(*operands[:smooth], x, *operands[smooth + 1:], **params)  # noqa: E731
                return jax.jvp(at, (operands[smooth],), (t,))[1]

            terms.append(_per_entry(along, batched + batched[smooth:smooth + 1])(*primals, tangents[smooth]))
        return out, sum_terms(terms, aval_of(out))

    return jvp


# ---- permute, unpermute and its backward ----------------------------------------------


def _permute_jvp(primals, tangents, *, batched, num_experts):
    tokens, expert_indices = primals
    outs = permute_p.bind(tokens, expert_indices, batched=batched, num_experts=num_experts)
    permuted, group_sizes, row_map = outs
    t_tokens = tangents[0]
    t_permuted = None if is_zero(t_tokens) else scatter_p.bind(
        t_tokens, row_map, placeholder(tokens.dtype), num_rows=permuted.shape[-2], has_weights=False,
        batched=(batched[0], any(batched), False))
    return outs, [sum_terms([t_permuted], aval_of(permuted)), zero_tangent(aval_of(group_sizes)),
                  zero_tangent(aval_of(row_map))]


def _permute_transpose(cts, tokens, expert_indices, *, batched, num_experts):
    """permuted is linear in tokens (linear_transpose): each token gets its rows' sum, the
    row_map re-derived from the indices by a permute of zero columns (no rows to copy)."""
    ct = cts[0]
    if is_zero(ct) or not ad.is_undefined_primal(tokens):
        return [None, None]
    tokens_b, indices_b = batched
    num_tokens, dtype = tokens.aval.shape[-2], tokens.aval.dtype
    row_map = permute_p.bind(jnp.zeros((num_tokens, 0), dtype), expert_indices, num_experts=num_experts,
                             batched=(False, indices_b))[2]
    flags = (any(batched), indices_b, False)
    dtokens = unpermute_p.bind(ct.astype(dtype), row_map, placeholder(dtype), has_weights=False, batched=flags)
    return [cotangent(dtokens, tokens, tokens_b, any(flags)), None]


permute_p = define("groupgemm_permute", expert_ffi_calls.permute, None, _permute_jvp,
                   _permute_transpose, multiple_results=True)


def _unpermute_transpose(ct, values, row_map, weights, *, batched, has_weights):
    results = [None] * 3
    if is_zero(ct):
        return results
    values_b, row_map_b, weights_b = batched
    out_b = any(batched)
    if ad.is_undefined_primal(values):
        dtype = values.aval.dtype
        # The core multiplies operands of one dtype: a wider cotangent is rounded once.
        flags = (out_b, row_map_b, weights_b)
        dvalues = scatter_p.bind(ct.astype(dtype), row_map, weights, num_rows=values.aval.shape[-2],
                                 has_weights=has_weights, batched=flags)
        results[0] = cotangent(dvalues, values, values_b, any(flags))
    if has_weights and ad.is_undefined_primal(weights):
        flags = (values_b, out_b, row_map_b)
        dweights = slot_dots_p.bind(values, ct.astype(values.dtype), row_map, dots_dtype=weights.aval.dtype,
                                    batched=flags)
        results[2] = cotangent(dweights, weights, weights_b, any(flags))
    return results


unpermute_p = define("groupgemm_unpermute", expert_ffi_calls.unpermute, "has_weights", (0, 2),
                     _unpermute_transpose)


def _scatter_transpose(ct, dout, row_map, weights, *, batched, num_rows, has_weights):
    results = [None] * 3
    if is_zero(ct):
        return results
    dout_b, row_map_b, weights_b = batched
    out_b = any(batched)
    if ad.is_undefined_primal(dout):
        flags = (out_b, row_map_b, weights_b)
        ddout = unpermute_p.bind(ct.astype(dout.aval.dtype), row_map, weights, has_weights=has_weights,
                                 batched=flags)
        results[0] = cotangent(ddout, dout, dout_b, any(flags))
    if has_weights and ad.is_undefined_primal(weights):
        flags = (out_b, dout_b, row_map_b)
        dweights = slot_dots_p.bind(ct.astype(dout.dtype), dout, row_map, dots_dtype=weights.aval.dtype,
                                    batched=flags)
        results[2] = cotangent(dweights, weights, weights_b, any(flags))
    return results


scatter_p = define("groupgemm_unpermute_scatter", expert_ffi_calls.unpermute_scatter, "has_weights", (0, 2),
                   _scatter_transpose)


def _slot_dots_transpose(ct, values, dout, row_map, *, batched, dots_dtype):
    results = [None] * 3
    if is_zero(ct):
        return results
    values_b, dout_b, row_map_b = batched
    out_b = any(batched)
    weights = ct.astype(dots_dtype)
    if ad.is_undefined_primal(values):
        flags = (dout_b, row_map_b, out_b)
        dvalues = scatter_p.bind(dout, row_map, weights, num_rows=values.aval.shape[-2], has_weights=True,
                                 batched=flags)
        results[0] = cotangent(dvalues, values, values_b, any(flags))
    if ad.is_undefined_primal(dout):
        flags = (values_b, row_map_b, out_b)
        ddout = unpermute_p.bind(values, row_map, weights, has_weights=True, batched=flags)
        results[1] = cotangent(ddout, dout, dout_b, any(flags))
    return results


slot_dots_p = define("groupgemm_unpermute_slot_dots", expert_ffi_calls.unpermute_slot_dots, None,
                     (0, 1), _slot_dots_transpose)


# ---- the activation ----------------------------------------------------------------------


def _silu_derivative(x):
    s = jax.nn.sigmoid(x)
    return s + x * s * (1 - s)


def _activation_grad_formula(dout, h, kind):
    """``J(h)^T dout`` with jax.numpy, as the core computes it (in float32, float64 for
    float64; groupgemm/activation.h): differentiated by JAX for second derivatives only."""
    name = contract.ACTIVATIONS[kind]
    acc = jnp.dtype(contract.accumulate_dtype(jnp.dtype(h.dtype).name))
    x, g = h.astype(acc), dout.astype(acc)
    if name == "swiglu":
        gate, up = jnp.split(x, 2, axis=1)
        grad = jnp.concatenate([g * up * _silu_derivative(gate), g * gate * jax.nn.sigmoid(gate)], axis=1)
    elif name == "gelu":
        grad = g * (0.5 * (1 + jax.lax.erf(x / math.sqrt(2))) + x * jnp.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))
    elif name == "relu":
        grad = jnp.where(x > 0, g, 0)
    else:
        grad = g * _silu_derivative(x)
    return grad.astype(h.dtype)


def _activation_tangent_formula(t, h, kind, width):
    """``J(h) t`` with jax.numpy, from _activation_grad_formula: J is diagonal for the
    elementwise activations; for swiglu (``silu(gate) * up``) the gate half of ``J^T``
    applied to t's gate half plus the up half of ``J^T`` applied to t's up half."""
    if contract.ACTIVATIONS[kind] != "swiglu":
        return _activation_grad_formula(t, h, kind)
    return (_activation_grad_formula(t[..., :width], h, kind)[..., :width]
            + _activation_grad_formula(t[..., width:], h, kind)[..., width:])


def _activation_tangent(t, h, *, batched, kind, width):
    """``J(h) t``, the activation's tangent, from the core's backward ``J^T`` (``batched``
    flags t and h): J is diagonal for the elementwise activations; for swiglu the backward
    of t's gate half gives ``t_gate * up * silu'(gate)`` in its gate half and of t's up half
    ``t_up * silu(gate)`` in its up half: their sum is ``J t``."""
    if contract.ACTIVATIONS[kind] != "swiglu":
        return activation_grad_p.bind(t, h, kind=kind, batched=batched)
    gate = activation_grad_p.bind(t[..., :width], h, kind=kind, batched=batched)[..., :width]
    up = activation_grad_p.bind(t[..., width:], h, kind=kind, batched=batched)[..., width:]
    return gate + up


def _activation_tangent_abstract(t, h, *, batched, kind, width):
    """The type of the operand with the result's rank (t when only t is batched), or of
    the one varying along more shard_map axes, with the activation's output shape."""
    features = width if contract.ACTIVATIONS[kind] == "swiglu" else h.shape[-1]
    only_t = batched[0] and not batched[1]
    shape = (t.shape[0],) * only_t + h.shape[:-1] + (features,)
    base = t if only_t else max((h, t), key=varying_count)
    return base.update(shape=shape, dtype=h.dtype, weak_type=False)


def _activation_tangent_transpose(ct, t, h, *, batched, kind, width):
    """``J^T ct``: one core call, as PyTorch's backward makes it (no arithmetic outside
    the core, whose floating-point mode then decides every bit)."""
    if is_zero(ct):
        return [None, None]
    t_b, h_b = batched
    dt = activation_grad_p.bind(ct, h, kind=kind, batched=(any(batched), h_b))
    return [cotangent(dt, t, t_b, any(batched)), None]


# J t, linear in t: forward mode evaluates it (from two core calls for swiglu), reverse mode
# transposes it into the core's J^T.
activation_tangent_p = primitive(
    "groupgemm_activation_tangent", mlir.lower_fun(_activation_tangent, multiple_results=False),
    _activation_tangent_abstract,
    _linear_and_formula_jvp(lambda: activation_tangent_p, 0, 1, _activation_tangent_formula),
    _activation_tangent_transpose, False)


def _activation_jvp(primals, tangents, *, batched, kind, width):
    (h,), (t,) = primals, tangents
    out = activation_p.bind(h, kind=kind, width=width, batched=batched)
    term = None if is_zero(t) else activation_tangent_p.bind(t, h, batched=batched * 2, kind=kind, width=width)
    return out, sum_terms([term], aval_of(out))


activation_p = define("groupgemm_activation", expert_ffi_calls.activation, None, _activation_jvp)


def _activation_grad_transpose(ct, dout, h, *, batched, kind):
    if is_zero(ct):
        return [None, None]
    dout_b, h_b = batched
    flags = (any(batched), h_b)
    dh = activation_tangent_p.bind(ct.astype(h.dtype), h, batched=flags, kind=kind, width=dout.aval.shape[-1])
    return [cotangent(dh, dout, dout_b, any(flags)), None]


activation_grad_p = define("groupgemm_activation_grad", expert_ffi_calls.activation_backward, None,
                           _linear_and_formula_jvp(lambda: activation_grad_p, 0, 1, _activation_grad_formula),
                           _activation_grad_transpose)


# ---- the router ----------------------------------------------------------------------


def _router_probs_formula(logits, indices, renormalize, probs_dtype):
    """probs as a function of the logits with the choices held fixed, with jax.numpy (the
    rule of groupgemm/router.h: a NaN logit counts as -inf, dropped slots are 0):
    differentiated by JAX for second derivatives only."""
    x = logits.astype(probs_dtype)
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)
    chosen = indices >= 0
    picked = jnp.take_along_axis(x, jnp.maximum(indices, 0), axis=1)
    top = jax.lax.stop_gradient(jnp.where(chosen[:, :1], picked[:, :1], 0))  # the max; probs do not depend on it
    weights = jnp.where(chosen, jnp.exp(jnp.where(chosen, picked, top) - top), 0)
    if renormalize:
        total = weights.sum(axis=1, keepdims=True)
    else:
        total = jnp.where(x > -jnp.inf, jnp.exp(jnp.where(x > -jnp.inf, x, top) - top), 0).sum(axis=1, keepdims=True)
    return jnp.where(chosen, weights / jnp.where(total > 0, total, 1), 0)


def _router_tangent_formula(logits, indices, tlogits, renormalize):
    probs = lambda x: _router_probs_formula(x, indices, renormalize, _probs_dtype(logits.dtype))  # noqa: E731
    return jax.jvp(probs, (logits,), (tlogits.astype(logits.dtype),))[1]


def _router_grad_formula(logits, indices, dprobs, renormalize):
    probs_dtype = _probs_dtype(logits.dtype)
    probs = lambda x: _router_probs_formula(x, indices, renormalize, probs_dtype)  # noqa: E731
    return jax.vjp(probs, logits)[1](dprobs.astype(probs_dtype))[0]


def _router_jvp(primals, tangents, *, batched, **params):
    (logits,), (t,) = primals, tangents
    probs, indices = outs = router_p.bind(logits, batched=batched, **params)
    t_probs = None if is_zero(t) else router_tangent_p.bind(logits, indices, t, renormalize=params["renormalize"],
                                                             batched=batched * 3)
    return outs, [sum_terms([t_probs], aval_of(probs)), zero_tangent(aval_of(indices))]


router_p = define("groupgemm_softmax_topk", expert_ffi_calls.softmax_topk, None, _router_jvp,
                  multiple_results=True)


def _probs_dtype(logits_dtype):
    return jnp.dtype(contract.accumulate_dtype(jnp.dtype(logits_dtype).name))


def _router_tangent_transpose(ct, logits, indices, tlogits, *, batched, renormalize):
    if is_zero(ct):
        return [None] * 3
    logits_b, indices_b, tlogits_b = batched
    flags = (logits_b, indices_b, any(batched))
    dtlogits = router_grad_p.bind(logits, indices, ct.astype(_probs_dtype(logits.dtype)), renormalize=renormalize,
                                  batched=flags)
    return [None, None, cotangent(dtlogits, tlogits, tlogits_b, any(flags))]


router_tangent_p = define("groupgemm_softmax_topk_tangent", expert_ffi_calls.softmax_topk_tangent, None,
                          _linear_and_formula_jvp(lambda: router_tangent_p, 2, 0, _router_tangent_formula),
                          _router_tangent_transpose)


def _router_grad_transpose(ct, logits, indices, dprobs, *, batched, renormalize):
    if is_zero(ct):
        return [None] * 3
    logits_b, indices_b, dprobs_b = batched
    flags = (logits_b, indices_b, any(batched))
    ddprobs = router_tangent_p.bind(logits, indices, ct.astype(logits.dtype), renormalize=renormalize, batched=flags)
    return [None, None, cotangent(ddprobs, dprobs, dprobs_b, any(flags))]


router_grad_p = define("groupgemm_softmax_topk_grad", expert_ffi_calls.softmax_topk_backward, None,
                       _linear_and_formula_jvp(lambda: router_grad_p, 2, 0, _router_grad_formula),
                       _router_grad_transpose)
