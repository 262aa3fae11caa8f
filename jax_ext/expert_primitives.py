"""The expert layer's ops as JAX primitives, so that every JAX transformation composes, as
for the grouped GEMMs (primitives.py): jit, vmap, forward and reverse mode to any order.

Token movement: three multilinear maps of (rows, slot weights, per-token values), each
lowered to one core call (expert_raw.py), each one's transposes the other two:
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
"""

import math

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from groupgemm import _contract as contract
from groupgemm.jax_ext import expert_raw
from groupgemm.jax_ext.primitives import aval_of, define, is_zero, placeholder, result, sum_terms


def _zero_like(aval):
    return ad.Zero(aval.to_tangent_aval())


def _weights(weights, has_weights):
    return weights if has_weights else None


# ---- permute, unpermute and its backward ----------------------------------------------


def _permute_abstract(tokens, expert_indices, *, num_experts):
    t, k = expert_indices.shape
    return (result((t * k, tokens.shape[1]), tokens.dtype, tokens, expert_indices),
            result((num_experts,), jnp.int32, tokens, expert_indices),
            result((t, k), jnp.int32, tokens, expert_indices))


def _permute_jvp(primals, tangents, *, num_experts):
    tokens, expert_indices = primals
    outs = permute_p.bind(tokens, expert_indices, num_experts=num_experts)
    permuted, group_sizes, row_map = outs
    t_permuted = (_zero_like(aval_of(permuted)) if is_zero(tangents[0]) else
                  scatter_p.bind(tangents[0], row_map, placeholder(tokens.dtype), num_rows=permuted.shape[0],
                                 has_weights=False))
    return outs, [t_permuted, _zero_like(aval_of(group_sizes)), _zero_like(aval_of(row_map))]


def _permute_transpose(cts, tokens, expert_indices, *, num_experts):
    """permuted is linear in tokens (linear_transpose): each token gets its rows' sum, the
    row_map re-derived from the indices by a permute of zero columns (no rows to copy)."""
    ct = cts[0]
    if is_zero(ct) or not ad.is_undefined_primal(tokens):
        return [None, None]
    num_tokens, dtype = tokens.aval.shape[0], tokens.aval.dtype
    row_map = permute_p.bind(jnp.zeros((num_tokens, 0), dtype), expert_indices, num_experts=num_experts)[2]
    return [unpermute_p.bind(ct.astype(dtype), row_map, placeholder(dtype), has_weights=False), None]


def _permute_call(tokens, expert_indices, *, num_experts):
    return list(expert_raw.permute(tokens, expert_indices, num_experts=num_experts))


permute_p = define("groupgemm_permute", _permute_call, _permute_abstract, _permute_jvp, _permute_transpose,
                   multiple_results=True)


def _unpermute_abstract(values, row_map, weights, *, has_weights):
    return result((row_map.shape[0], values.shape[1]), values.dtype, values, row_map, weights)


def _unpermute_jvp(primals, tangents, *, has_weights):
    values, row_map, weights = primals
    t_values, _, t_weights = tangents
    out = unpermute_p.bind(values, row_map, weights, has_weights=has_weights)
    terms = [
        None if is_zero(t_values) else unpermute_p.bind(t_values, row_map, weights, has_weights=has_weights),
        None if not has_weights or is_zero(t_weights) else unpermute_p.bind(values, row_map, t_weights,
                                                                             has_weights=True),
    ]
    return out, sum_terms(terms, aval_of(out))


def _unpermute_transpose(ct, values, row_map, weights, *, has_weights):
    results = [None] * 3
    if is_zero(ct):
        return results
    if ad.is_undefined_primal(values):
        dtype = values.aval.dtype
        # The core multiplies operands of one dtype: a wider cotangent is rounded once.
        results[0] = scatter_p.bind(ct.astype(dtype), row_map, weights, num_rows=values.aval.shape[0],
                                    has_weights=has_weights)
    if has_weights and ad.is_undefined_primal(weights):
        results[2] = slot_dots_p.bind(values, ct.astype(values.dtype), row_map, dots_dtype=weights.aval.dtype)
    return results


def _unpermute_call(values, row_map, weights, *, has_weights):
    return expert_raw.unpermute(values, row_map, _weights(weights, has_weights))


unpermute_p = define("groupgemm_unpermute", _unpermute_call, _unpermute_abstract, _unpermute_jvp,
                     _unpermute_transpose)


def _scatter_abstract(dout, row_map, weights, *, num_rows, has_weights):
    return result((num_rows, dout.shape[1]), dout.dtype, dout, row_map, weights)


def _scatter_jvp(primals, tangents, **params):
    dout, row_map, weights = primals
    t_dout, _, t_weights = tangents
    out = scatter_p.bind(dout, row_map, weights, **params)
    terms = [
        None if is_zero(t_dout) else scatter_p.bind(t_dout, row_map, weights, **params),
        None if not params["has_weights"] or is_zero(t_weights) else scatter_p.bind(dout, row_map, t_weights,
                                                                                     **params),
    ]
    return out, sum_terms(terms, aval_of(out))


def _scatter_transpose(ct, dout, row_map, weights, *, num_rows, has_weights):
    results = [None] * 3
    if is_zero(ct):
        return results
    if ad.is_undefined_primal(dout):
        results[0] = unpermute_p.bind(ct.astype(dout.aval.dtype), row_map, weights, has_weights=has_weights)
    if has_weights and ad.is_undefined_primal(weights):
        results[2] = slot_dots_p.bind(ct.astype(dout.dtype), dout, row_map, dots_dtype=weights.aval.dtype)
    return results


def _scatter_call(dout, row_map, weights, *, num_rows, has_weights):
    return expert_raw.unpermute_backward(dout, None, row_map, _weights(weights, has_weights), num_rows=num_rows)[0]


scatter_p = define("groupgemm_unpermute_scatter", _scatter_call, _scatter_abstract, _scatter_jvp,
                   _scatter_transpose)


def _slot_dots_abstract(values, dout, row_map, *, dots_dtype):
    return result(row_map.shape, dots_dtype, values, dout, row_map)


def _slot_dots_jvp(primals, tangents, **params):
    values, dout, row_map = primals
    t_values, t_dout, _ = tangents
    out = slot_dots_p.bind(values, dout, row_map, **params)
    terms = [None if is_zero(t_values) else slot_dots_p.bind(t_values, dout, row_map, **params),
             None if is_zero(t_dout) else slot_dots_p.bind(values, t_dout, row_map, **params)]
    return out, sum_terms(terms, aval_of(out))


def _slot_dots_transpose(ct, values, dout, row_map, *, dots_dtype):
    results = [None] * 3
    if is_zero(ct):
        return results
    weights = ct.astype(dots_dtype)
    if ad.is_undefined_primal(values):
        results[0] = scatter_p.bind(dout, row_map, weights, num_rows=values.aval.shape[0], has_weights=True)
    if ad.is_undefined_primal(dout):
        results[1] = unpermute_p.bind(values, row_map, weights, has_weights=True)
    return results


def _slot_dots_call(values, dout, row_map, *, dots_dtype):
    return expert_raw.unpermute_backward(dout, values, row_map, None, num_rows=values.shape[0],
                                         dprobs_dtype=dots_dtype, want_dpermuted=False)[1]


slot_dots_p = define("groupgemm_unpermute_slot_dots", _slot_dots_call, _slot_dots_abstract, _slot_dots_jvp,
                     _slot_dots_transpose)


# ---- the activation ----------------------------------------------------------------------


def _silu_derivative(x):
    s = jax.nn.sigmoid(x)
    return s + x * s * (1 - s)


def _activation_grad_formula(dout, h, kind):
    """``J(h)^T dout`` with jax.numpy, as the core computes it (in float32, float64 for
    float64; groupgemm/activation.h): differentiated by JAX for second derivatives only."""
    name = contract.ACTIVATIONS[kind]
    acc = jnp.float64 if h.dtype == jnp.float64 else jnp.float32
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


def _activation_tangent(h, t, kind, width):
    """``J(h) t``, the activation's tangent, from the core's backward ``J^T``: J is diagonal
    for the elementwise activations; for swiglu (``silu(gate) * up``) the backward of t's
    gate half gives ``t_gate * up * silu'(gate)`` in its gate half and of t's up half
    ``t_up * silu(gate)`` in its up half: their sum is ``J t``."""
    if contract.ACTIVATIONS[kind] != "swiglu":
        return activation_grad_p.bind(t, h, kind=kind)
    gate = activation_grad_p.bind(t[:, :width], h, kind=kind)[:, :width]
    up = activation_grad_p.bind(t[:, width:], h, kind=kind)[:, width:]
    return gate + up


def _activation_abstract(h, *, kind, width):
    return result((h.shape[0], width), h.dtype, h)


def _activation_jvp(primals, tangents, *, kind, width):
    (h,), (t,) = primals, tangents
    out = activation_p.bind(h, kind=kind, width=width)
    return out, _zero_like(aval_of(out)) if is_zero(t) else _activation_tangent(h, t, kind, width)


def _activation_call(h, *, kind, width):
    return expert_raw.activation(h, kind=kind, width=width)


activation_p = define("groupgemm_activation", _activation_call, _activation_abstract, _activation_jvp)


def _activation_grad_abstract(dout, h, *, kind):
    return result(h.shape, h.dtype, dout, h)


def _activation_grad_jvp(primals, tangents, *, kind):
    dout, h = primals
    t_dout, t_h = tangents
    out = activation_grad_p.bind(dout, h, kind=kind)
    terms = [None if is_zero(t_dout) else activation_grad_p.bind(t_dout, h, kind=kind),
             None if is_zero(t_h) else jax.jvp(lambda x: _activation_grad_formula(dout, x, kind), (h,), (t_h,))[1]]
    return out, sum_terms(terms, aval_of(out))


def _activation_grad_transpose(ct, dout, h, *, kind):
    if is_zero(ct):
        return [None, None]
    return [_activation_tangent(h, ct.astype(h.dtype), kind, dout.aval.shape[1]), None]


def _activation_grad_call(dout, h, *, kind):
    return expert_raw.activation_backward(dout, h, kind=kind)


activation_grad_p = define("groupgemm_activation_grad", _activation_grad_call, _activation_grad_abstract,
                           _activation_grad_jvp, _activation_grad_transpose)


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


def _router_tangent_formula(logits, indices, tlogits, renormalize, probs_dtype):
    probs = lambda x: _router_probs_formula(x, indices, renormalize, probs_dtype)  # noqa: E731
    return jax.jvp(probs, (logits,), (tlogits.astype(logits.dtype),))[1]


def _router_grad_formula(logits, indices, dprobs, renormalize, probs_dtype):
    probs = lambda x: _router_probs_formula(x, indices, renormalize, probs_dtype)  # noqa: E731
    return jax.vjp(probs, logits)[1](dprobs.astype(probs_dtype))[0]


def _router_abstract(logits, *, k, renormalize, probs_dtype):
    return (result((logits.shape[0], k), probs_dtype, logits),
            result((logits.shape[0], k), jnp.int32, logits))


def _router_jvp(primals, tangents, **params):
    (logits,), (t,) = primals, tangents
    probs, indices = outs = router_p.bind(logits, **params)
    t_probs = (_zero_like(aval_of(probs)) if is_zero(t) else
               router_tangent_p.bind(logits, indices, t, renormalize=params["renormalize"]))
    return outs, [t_probs, _zero_like(aval_of(indices))]


def _router_call(logits, *, k, renormalize, probs_dtype):
    return list(expert_raw.softmax_topk(logits, k=k, probs_dtype=probs_dtype, renormalize=renormalize))


router_p = define("groupgemm_softmax_topk", _router_call, _router_abstract, _router_jvp, multiple_results=True)


def _probs_dtype(logits_dtype):
    return jnp.dtype(contract.accumulate_dtype(jnp.dtype(logits_dtype).name))


def _router_tangent_abstract(logits, indices, tlogits, *, renormalize):
    return result(indices.shape, _probs_dtype(logits.dtype), logits, indices, tlogits)


def _router_tangent_jvp(primals, tangents, *, renormalize):
    logits, indices, tlogits = primals
    t_logits, _, t_tlogits = tangents
    out = router_tangent_p.bind(logits, indices, tlogits, renormalize=renormalize)
    formula = lambda x: _router_tangent_formula(x, indices, tlogits, renormalize, out.dtype)  # noqa: E731
    terms = [None if is_zero(t_tlogits) else router_tangent_p.bind(logits, indices, t_tlogits,
                                                                     renormalize=renormalize),
             None if is_zero(t_logits) else jax.jvp(formula, (logits,), (t_logits,))[1]]
    return out, sum_terms(terms, aval_of(out))


def _router_tangent_transpose(ct, logits, indices, tlogits, *, renormalize):
    if is_zero(ct):
        return [None] * 3
    return [None, None, router_grad_p.bind(logits, indices, ct.astype(_probs_dtype(logits.dtype)),
                                           renormalize=renormalize)]


def _router_tangent_call(logits, indices, tlogits, *, renormalize):
    return expert_raw.softmax_topk_tangent(logits, indices, tlogits, renormalize=renormalize)


router_tangent_p = define("groupgemm_softmax_topk_tangent", _router_tangent_call, _router_tangent_abstract,
                          _router_tangent_jvp, _router_tangent_transpose)


def _router_grad_abstract(logits, indices, dprobs, *, renormalize):
    return result(logits.shape, logits.dtype, logits, indices, dprobs)


def _router_grad_jvp(primals, tangents, *, renormalize):
    logits, indices, dprobs = primals
    t_logits, _, t_dprobs = tangents
    out = router_grad_p.bind(logits, indices, dprobs, renormalize=renormalize)
    probs_dtype = _probs_dtype(logits.dtype)
    formula = lambda x: _router_grad_formula(x, indices, dprobs, renormalize, probs_dtype)  # noqa: E731
    terms = [None if is_zero(t_dprobs) else router_grad_p.bind(logits, indices, t_dprobs, renormalize=renormalize),
             None if is_zero(t_logits) else jax.jvp(formula, (logits,), (t_logits,))[1]]
    return out, sum_terms(terms, aval_of(out))


def _router_grad_transpose(ct, logits, indices, dprobs, *, renormalize):
    if is_zero(ct):
        return [None] * 3
    return [None, None, router_tangent_p.bind(logits, indices, ct.astype(logits.dtype), renormalize=renormalize)]


def _router_grad_call(logits, indices, dprobs, *, renormalize):
    return expert_raw.softmax_topk_backward(logits, indices, dprobs, renormalize=renormalize)


router_grad_p = define("groupgemm_softmax_topk_grad", _router_grad_call, _router_grad_abstract, _router_grad_jvp,
                       _router_grad_transpose)
