"""The fused expert MLP as JAX primitives (expert_mlp_ffi_calls.py), so that every JAX
transformation composes (jit, vmap, forward and reverse mode to any order) while a
gradient keeps only what the fused backward reads:

- ``expert_mlp_p(tokens, expert_indices, w_in, w_out, group_offset, probs, b_in, b_out)``
  -> ``(out, h)``: the forward, one core call; ``h`` (fc1's output per slot) is a result
  only with ``want_h``, which its jvp rule asks for;
- ``expert_mlp_tangent_p(t_tokens, t_w_in, t_w_out, t_probs, t_b_in, t_b_out, tokens,
  expert_indices, w_in, w_out, group_offset, probs, b_out, h)`` -> ``t_out``: the forward's
  tangent, jointly linear in the six tangents. Forward mode evaluates it as the
  composition does (permute, the grouped MLP's tangent, unpermute); reverse mode
  transposes it into
- ``expert_mlp_backward_p(dout, tokens, expert_indices, w_in, w_out, group_offset, h,
  probs, b_out)`` -> the six gradients, one core call, linear in dout; its transpose is
  the tangent (J^T and J).

So a reverse pass saves the inputs, the integer routing and h, the activation is
recomputed, and nothing [T*k, H] outlives the forward. How the tangent and the backward
change with their other operands (second order and up) JAX differentiates from the
composition written with the expert layer's own ops (``_Composition``), as
expert_primitives.py does for the activation and the router. An absent operand (probs, a
bias, a tangent) is a flagged size-0 placeholder; a call leaves it out.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, mlir

from groupgemm import _contract as contract
from groupgemm.jax_ext import expert_mlp_ffi_calls
from groupgemm.jax_ext.expert import permute, unpermute
from groupgemm.jax_ext.expert_primitives import (
    _per_entry,
    activation_grad_p,
    activation_p,
    activation_tangent_p,
    scatter_p,
    slot_dots_p,
)
from groupgemm.jax_ext.functional import grouped_matmul, grouped_matmul_wgrad
from groupgemm.jax_ext.partitioning import reshaped, varying_count
from groupgemm.jax_ext.primitives import (
    aval_of,
    bias_grad_p,
    bias_rows,
    cotangent,
    is_zero,
    placeholder,
    primitive,
    sum_terms,
    zero_tangent,
)

# Operand positions of the differentiable operands (expert_mlp_ffi_calls.DIFFERENTIABLE's
# order) in the forward's operands, and the positions of the tangent's non-linear operands
# that have tangents of their own.
_FORWARD_DIFFERENTIABLE = (0, 2, 3, 5, 6, 7)
_TANGENT_SMOOTH = (6, 8, 9, 11, 12, 13)  # tokens, w_in, w_out, probs, b_out, h
_BACKWARD_SMOOTH = (1, 3, 4, 6, 7, 8)  # tokens, w_in, w_out, h, probs, b_out


def _define(name, ffi_call, present, jvp, transpose=None):
    """A primitive of a partitioned FFI call with several results, whose optional operands
    are placeholders when absent: ``present(params)`` gives the operands the call takes."""

    def pick(operands, batched, params):
        keep = present(params)
        return [operands[i] for i in keep], tuple(batched[i] for i in keep)

    def abstract(*avals, batched, **params):
        args, flags = pick(avals, batched, params)
        return ffi_call.abstract(*args, batched=flags, **params)

    def lowering(ctx, *values, batched, **params):
        def call(*operands):
            args, flags = pick(operands, batched, params)
            return list(ffi_call.lowered(ctx, len(args), flags, params)(*args))

        return mlir.lower_fun(call, multiple_results=True)(ctx, *values)

    return primitive(name, lowering, abstract, jvp, transpose, multiple_results=True)


def _smooth_jvp(formula, primals, tangents, smooth, batched, params):
    """The jvp of ``formula(*primals, **params)`` along the tangents of the operands at
    positions ``smooth`` (the others held fixed), for one call or each entry of a batch."""
    live = [i for i in smooth if not is_zero(tangents[i])]
    if not live:
        return None

    def along(*operands):  # the primals, then the live operands' tangents
        fixed, moved = operands[:len(primals)], operands[len(primals):]

        def at(*xs):
            full = list(fixed)
            for i, x in zip(live, xs):
                full[i] = x
            return formula(*full, **params)

        return jax.jvp(at, [fixed[i] for i in live], list(moved))[1]

    flags = tuple(batched) + tuple(batched[i] for i in live)
    return _per_entry(along, flags)(*primals, *(tangents[i] for i in live))


# ---- the composition: the formulas JAX differentiates ---------------------------------------


def window_ids(expert_indices, group_offset, num_experts):
    """Each slot's local expert, or -1 when it is dropped (groupgemm/expert_mlp.h's
    window_bucket: a negative id, or one outside [group_offset, group_offset + E))."""
    if expert_indices.dtype == jnp.uint32 and group_offset.dtype == jnp.int32:  # no common signed type
        offset = group_offset.astype(jnp.uint32)  # a negative one wraps to 2^32 + group_offset
        local = expert_indices - offset  # wraps too; the window's ids get id - group_offset
        inside = jnp.where(group_offset >= 0, (expert_indices >= offset) & (local < num_experts),
                           expert_indices < jnp.maximum(group_offset + num_experts, 0).astype(jnp.uint32))
        return jnp.where(inside, local.astype(jnp.int32), -1)
    common = jnp.promote_types(expert_indices.dtype, group_offset.dtype)
    ids, offset = expert_indices.astype(common), group_offset.astype(common)
    unsigned = jnp.uint64 if common == jnp.int64 else jnp.uint32
    inside = (ids >= 0) & (ids >= offset) & (ids.astype(unsigned) - offset.astype(unsigned) < num_experts)
    return jnp.where(inside, ids - offset, -1).astype(jnp.int32)


class _Composition:
    """The expert layer as permute, the grouped MLP and unpermute compute it, from the
    fused op's operands (one entry of a batch): the rows, each piece made when first used."""

    def __init__(self, tokens, expert_indices, w_in, w_out, group_offset, probs, b_out, h, kind, transpose_rhs):
        self.tokens, self.w_in, self.w_out, self.probs, self.b_out, self.h = tokens, w_in, w_out, probs, b_out, h
        self.kind, self.transpose = kind, transpose_rhs
        self.experts = w_in.shape[0]
        self.local = window_ids(expert_indices, group_offset, self.experts)

    def rows(self, x):
        """``x [T, H]``'s rows in the routing's order."""
        return permute(x, self.local, self.experts)[0]

    @functools.cached_property
    def routed(self):
        return permute(self.tokens, self.local, self.experts)

    @property
    def x(self):
        return self.routed[0]

    @property
    def sizes(self):
        return self.routed[1]

    @property
    def row_map(self):
        return self.routed[2]

    @functools.cached_property
    def h_rows(self):
        """h [T, k, F_in] (slot order) in the routing's order: a permute of its T*k slots."""
        t, k, f_in = self.h.shape
        return permute(reshaped(self.h, (t * k, f_in)), reshaped(self.local, (t * k, 1)), self.experts)[0]

    @functools.cached_property
    def act(self):
        f_in = self.h.shape[-1]
        return activation_p.bind(self.h_rows, kind=self.kind,
                                 width=contract.activation_width(contract.ACTIVATIONS[self.kind], f_in, "expert_mlp"))

    @functools.cached_property
    def y(self):
        return self.matmul(self.act, self.w_out, bias=self.b_out)

    def matmul(self, lhs, rhs, *, bias=None, flip=False):
        """The grouped GEMM with rhs as it is stored (flip: its transpose, a dgrad)."""
        return grouped_matmul(lhs, rhs, self.sizes, bias=bias, transpose_rhs=self.transpose != flip)

    def bias_rows(self, bias):
        return bias_rows(bias, self.sizes, jnp.zeros((), jnp.int32), num_rows=self.x.shape[0], transpose_rhs=False,
                         out_dtype=bias.dtype)

    def wgrad(self, lhs, grad):
        """The weight gradient in rhs's layout: lhs^T grad, or grad^T lhs when transposed."""
        a, b = (grad, lhs) if self.transpose else (lhs, grad)
        return grouped_matmul_wgrad(a, b, self.sizes, num_groups=self.experts)

    def bias_grad(self, grad):
        return bias_grad_p.bind(grad, self.sizes, jnp.zeros((), jnp.int32), num_groups=self.experts,
                                out_dtype=grad.dtype)


def _composition(tokens, expert_indices, w_in, w_out, group_offset, probs, b_out, h, *, kind, transpose_rhs,
                 has_probs, has_b_out):
    return _Composition(tokens, expert_indices, w_in, w_out, group_offset, probs if has_probs else None,
                        b_out if has_b_out else None, h, kind, transpose_rhs)


def _total(terms, like):
    terms = [t for t in terms if t is not None]
    return functools.reduce(jnp.add, terms) if terms else jnp.zeros(like.shape, like.dtype)


def _tangent_formula(t_tokens, t_w_in, t_w_out, t_probs, t_b_in, t_b_out, tokens, expert_indices, w_in, w_out,
                     group_offset, probs, b_out, h, *, kind, transpose_rhs, has_probs, has_b_out, has_t):
    """out's tangent, as the composition's: fc1's output tangent through the activation's
    Jacobian, fc2's, then unpermute's (and its weights' tangent times the expert outputs)."""
    c = _composition(tokens, expert_indices, w_in, w_out, group_offset, probs, b_out, h, kind=kind,
                     transpose_rhs=transpose_rhs, has_probs=has_probs, has_b_out=has_b_out)
    has_tokens, has_w_in, has_w_out, has_probs_t, has_b_in, has_b_out_t = has_t
    t_h = [c.matmul(c.rows(t_tokens), w_in) if has_tokens else None, c.matmul(c.x, t_w_in) if has_w_in else None,
           c.bias_rows(t_b_in) if has_b_in else None]
    t_y = [c.matmul(c.act, t_w_out) if has_w_out else None, c.bias_rows(t_b_out) if has_b_out_t else None]
    if any(t is not None for t in t_h):
        t_act = activation_tangent_p.bind(_total(t_h, c.h_rows), c.h_rows, kind=kind, width=c.act.shape[-1])
        t_y.append(c.matmul(t_act, w_out))
    terms = [unpermute(_total(t_y, c.x), c.row_map, c.probs) if any(t is not None for t in t_y) else None,
             unpermute(c.y, c.row_map, t_probs) if has_probs_t else None]
    return _total(terms, tokens)


def _backward_formula(dout, tokens, expert_indices, w_in, w_out, group_offset, h, probs, b_out, *, kind,
                      transpose_rhs, has_probs, has_b_out, want, probs_dtype):
    """The six gradients as the composition's backward computes them (unwanted ones size-0
    placeholders)."""
    c = _composition(tokens, expert_indices, w_in, w_out, group_offset, probs, b_out, h, kind=kind,
                     transpose_rhs=transpose_rhs, has_probs=has_probs, has_b_out=has_b_out)
    weights = c.probs if has_probs else placeholder(dout.dtype)
    dy = scatter_p.bind(dout, c.row_map, weights, num_rows=c.x.shape[0], has_weights=has_probs)
    dh = activation_grad_p.bind(c.matmul(dy, w_out, flip=True), c.h_rows, kind=kind)
    grads = (
        lambda: unpermute(c.matmul(dh, w_in, flip=True), c.row_map),
        lambda: c.wgrad(c.x, dh),
        lambda: c.wgrad(c.act, dy),
        lambda: slot_dots_p.bind(c.y, dout, c.row_map, dots_dtype=probs_dtype),
        lambda: c.bias_grad(dh),
        lambda: c.bias_grad(dy),
    )
    return tuple(grad() if wanted else placeholder(dout.dtype) for grad, wanted in zip(grads, want))


def _h_formula(tokens, expert_indices, w_in, group_offset, b_in, *, transpose_rhs, has_b_in):
    """h [T, k, F_in]: each slot's fc1 output (exact zeros for a dropped slot)."""
    t, k = expert_indices.shape
    local = window_ids(expert_indices, group_offset, w_in.shape[0])
    x, sizes, row_map = permute(tokens, local, w_in.shape[0])
    rows = grouped_matmul(x, w_in, sizes, bias=b_in if has_b_in else None, transpose_rhs=transpose_rhs)
    return reshaped(unpermute(rows, reshaped(row_map, (t * k, 1))), (t, k, rows.shape[-1]))


# ---- the forward ------------------------------------------------------------------------------


def _forward_present(params):
    return (0, 1, 2, 3, 4) + (5,) * params["has_probs"] + (6,) * params["has_b_in"] + (7,) * params["has_b_out"]


def _forward_jvp(primals, tangents, *, batched, want_h, **params):
    out, h = expert_mlp_p.bind(*primals, batched=batched, want_h=True, **params)
    tokens, expert_indices, w_in, w_out, group_offset, probs, b_in, b_out = primals
    present = (True, True, True, params["has_probs"], params["has_b_in"], params["has_b_out"])
    has_t = tuple(p and not is_zero(tangents[i]) for p, i in zip(present, _FORWARD_DIFFERENTIABLE))
    t_out = None
    if any(has_t):
        none = placeholder(tokens.dtype)
        t_ops = [tangents[i] if has else none for i, has in zip(_FORWARD_DIFFERENTIABLE, has_t)]
        t_flags = tuple(batched[i] and has for i, has in zip(_FORWARD_DIFFERENTIABLE, has_t))
        t_out = expert_mlp_tangent_p.bind(
            *t_ops, tokens, expert_indices, w_in, w_out, group_offset, probs, b_out, h,
            batched=t_flags + tuple(batched[i] for i in (0, 1, 2, 3, 4, 5, 7)) + (any(batched),),
            kind=params["kind"], transpose_rhs=params["transpose_rhs"], has_probs=params["has_probs"],
            has_b_out=params["has_b_out"], has_t=has_t)
    t_h = None
    if want_h:
        formula = functools.partial(_h_formula, transpose_rhs=params["transpose_rhs"], has_b_in=params["has_b_in"])
        h_primals = (tokens, expert_indices, w_in, group_offset, b_in)
        h_tangents = tuple(tangents[i] for i in (0, 1, 2, 4, 6))
        t_h = _smooth_jvp(formula, h_primals, h_tangents, (0, 2, 4), tuple(batched[i] for i in (0, 1, 2, 4, 6)), {})
    else:  # the result the call declared: a size-0 placeholder (typed as the forward's results are)
        lead = int(any(batched))  # (-1 cannot size the rest of an empty batch)
        h = h.reshape(h.shape[:lead] + (math.prod(h.shape[lead:]),))[..., :0]
    return [out, h], [sum_terms([t_out], aval_of(out)), sum_terms([t_h], aval_of(h))]


expert_mlp_p = _define("groupgemm_expert_mlp", expert_mlp_ffi_calls.expert_mlp, _forward_present, _forward_jvp)


# ---- the tangent, whose transpose is the backward ---------------------------------------------


def _tangent_eval(*operands, batched, **params):
    return _per_entry(functools.partial(_tangent_formula, **params), batched)(*operands)


def _tangent_abstract(*avals, batched, **params):
    """[T, H] in tokens' dtype (leading the batch when any operand has it), typed like the
    operand that varies along the most shard_map axes."""
    tokens = avals[6]
    lead = next((a.shape[:1] for a, b in zip(avals, batched) if b), ())
    base = max(avals, key=varying_count)
    return base.update(shape=lead + tokens.shape[-2:], dtype=tokens.dtype, weak_type=False)


def _tangent_jvp(primals, tangents, *, batched, **params):
    out = expert_mlp_tangent_p.bind(*primals, batched=batched, **params)
    terms = []
    moved = tuple(has and not is_zero(t) for has, t in zip(params["has_t"], tangents[:6]))
    if any(moved):  # linear in the tangent operands
        none = placeholder(primals[6].dtype)
        ops = [t if m else none for t, m in zip(tangents[:6], moved)]
        flags = tuple(b and m for b, m in zip(batched[:6], moved)) + tuple(batched[6:])
        terms.append(expert_mlp_tangent_p.bind(*ops, *primals[6:], batched=flags, **dict(params, has_t=moved)))
    smooth = [i for i, has in zip(_TANGENT_SMOOTH, (True, True, True, params["has_probs"], params["has_b_out"], True))
              if has]
    terms.append(_smooth_jvp(_tangent_formula, primals, tangents, smooth, batched, params))
    return out, sum_terms(terms, aval_of(out))


def _tangent_transpose(ct, *operands, batched, kind, transpose_rhs, has_probs, has_b_out, has_t):
    if any(ad.is_undefined_primal(x) for x in operands[6:]):
        raise NotImplementedError("groupgemm: the expert MLP's tangent is linear in its tangents only")
    want = tuple(has and ad.is_undefined_primal(x) for has, x in zip(has_t, operands[:6]))
    if is_zero(ct) or not any(want):
        return [None] * len(operands)
    tokens, expert_indices, w_in, w_out, group_offset, probs, b_out, h = operands[6:]
    probs_dtype = operands[3].aval.dtype if want[3] else tokens.dtype
    flags = (any(batched),) + tuple(batched[i] for i in (6, 7, 8, 9, 10, 13, 11, 12))
    grads = expert_mlp_backward_p.bind(
        ct.astype(tokens.dtype), tokens, expert_indices, w_in, w_out, group_offset, h, probs, b_out, batched=flags,
        kind=kind, transpose_rhs=transpose_rhs, has_probs=has_probs, has_b_out=has_b_out, want=want,
        probs_dtype=np.dtype(probs_dtype))
    results = [cotangent(g, operands[i], batched[i], any(flags)) if w else None
               for i, (g, w) in enumerate(zip(grads, want))]
    return results + [None] * 8


expert_mlp_tangent_p = primitive("groupgemm_expert_mlp_tangent", mlir.lower_fun(_tangent_eval, multiple_results=False),
                                 _tangent_abstract, _tangent_jvp, _tangent_transpose, multiple_results=False)


# ---- the backward -------------------------------------------------------------------------------


def _backward_present(params):
    return (0, 1, 2, 3, 4, 5, 6) + (7,) * params["has_probs"] + (8,) * params["has_b_out"]


def _backward_jvp(primals, tangents, *, batched, **params):
    outs = expert_mlp_backward_p.bind(*primals, batched=batched, **params)
    terms = [[] for _ in outs]
    if not is_zero(tangents[0]):  # linear in dout
        for term, g in zip(terms, expert_mlp_backward_p.bind(tangents[0], *primals[1:], batched=batched, **params)):
            term.append(g)
    smooth = [i for i, has in zip(_BACKWARD_SMOOTH, (True, True, True, True, params["has_probs"],
                                                     params["has_b_out"])) if has]
    moved = _smooth_jvp(_backward_formula, primals, tangents, smooth, batched, params)
    if moved is not None:
        for term, g in zip(terms, moved):
            term.append(g)
    return outs, [sum_terms(term, aval_of(out)) if wanted else zero_tangent(aval_of(out))
                  for term, out, wanted in zip(terms, outs, params["want"])]


def _backward_transpose(cts, dout, *operands, batched, kind, transpose_rhs, has_probs, has_b_out, want, probs_dtype):
    if any(ad.is_undefined_primal(x) for x in operands):
        raise NotImplementedError("groupgemm: the expert MLP's backward is linear in dout only")
    has_t = tuple(w and not is_zero(ct) for w, ct in zip(want, cts))
    if not ad.is_undefined_primal(dout) or not any(has_t):
        return [None] * (1 + len(operands))
    tokens, expert_indices, w_in, w_out, group_offset, h, probs, b_out = operands
    dtypes = (tokens.dtype,) * 3 + (probs_dtype,) + (tokens.dtype,) * 2
    ts = [ct.astype(d) if has else placeholder(tokens.dtype) for ct, d, has in zip(cts, dtypes, has_t)]
    cts_b = any(batched)
    flags = tuple(cts_b and has for has in has_t) + tuple(batched[i] for i in (1, 2, 3, 4, 5, 7, 8, 6))
    d_dout = expert_mlp_tangent_p.bind(*ts, tokens, expert_indices, w_in, w_out, group_offset, probs, b_out, h,
                                       batched=flags, kind=kind, transpose_rhs=transpose_rhs, has_probs=has_probs,
                                       has_b_out=has_b_out, has_t=has_t)
    return [cotangent(d_dout, dout, batched[0], any(flags))] + [None] * len(operands)


expert_mlp_backward_p = _define("groupgemm_expert_mlp_backward", expert_mlp_ffi_calls.expert_mlp_backward,
                                _backward_present, _backward_jvp, _backward_transpose)
