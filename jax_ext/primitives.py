"""The grouped GEMMs as JAX primitives, so that every JAX transformation composes: jit,
vmap, forward and reverse mode to any order (jvp, vjp, jacfwd, jacrev, hessian,
linear_transpose).

The primitives, each lowered to its XLAn FFI calls (ffi_calls.py):
- ``matmul_p``: ``out[r] = lhs[r] @ rhs[g] (+ bias[g])``, bilinear in (lhs, rhs), affine in bias;
- ``wgrad_p``: ``out[g] = lhs_g^T @ grad_g (+ acc[g])``, bilinear in (lhs, grad), affine in acc;
- ``bias_grad_p``: ``out[g] = sum of grad_g's rows``, linear in grad;
- ``matmul_tangent_p``: the matmul's tangent, jointly linear in its tangents, whose
  transpose is ``backward_p``: dlhs, drhs and dbias from one core call.
Their tangents and transposes are these same primitives on the same groups (the rows
past every group stay padding throughout), so a gradient of any order keeps the exact
zeros of the first, and the first-order gradients are the very calls the PyTorch
frontend makes (same bits). An absent bias or accumulator is a size-0 placeholder.

Each lowers to its FFI call, partitioned under jit with sharded operands (partitioning.py).
The ``batched`` parameter flags the operands that carry a leading vmapped axis: vmap binds
the primitive once for the whole batch (the FFI call maps over it on each device, so a
sharded batch axis stays where it is), and a transpose sums the cotangent of an operand
without that axis over it. It defaults to no operand batched, so only the rules pass it.
``define`` and the helpers beside it make the expert layer's primitives the same way
(expert_primitives.py).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from groupgemm.jax_ext import ffi_calls
from groupgemm.jax_ext.ffi_calls import placeholder
from groupgemm.jax_ext.partitioning import lowers_to_partitioned_calls, map_leading, typed_like


def aval_of(x):
    return jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)


def is_zero(t):
    return type(t) is ad.Zero


def zero_tangent(aval):
    return ad.Zero(aval.to_tangent_aval())


def sum_terms(terms, aval):
    """The tangent of a result of abstract value ``aval`` from its terms (None: a zero term)."""
    terms = [typed_like(t, aval) for t in terms if t is not None]
    return functools.reduce(jnp.add, terms) if terms else zero_tangent(aval)


def cotangent(x, operand, operand_batched, result_batched):
    """The cotangent of an undefined ``operand``: summed over the vmapped axis the operand
    lacks, typed like the operand on a mesh with explicit axes."""
    return typed_like(x.sum(0) if result_batched and not operand_batched else x, operand.aval)


def define(name, ffi_call, optional, jvp, transpose=None, multiple_results=False):
    """The primitive of a partitioned FFI call (ffi_calls.py, expert_ffi_calls.py), lowered
    to the call. ``optional`` is None, or the static parameter that says whether the last
    operand (a bias, an accumulator, probs) is present: the FFI call takes it only then,
    and takes the other static parameters. It has the FFI call's first result, or all of
    them. ``jvp`` is a rule, or the indices of the operands the call is linear in, each
    separately (bilinear in two): its tangent is then the sum of the call with one present
    operand's tangent in its place."""
    pick = (lambda results: list(results)) if multiple_results else (lambda results: results[0])
    present = functools.partial(_present, optional)
    if isinstance(jvp, tuple):  # the rule binds `prim`, made below
        jvp = _multilinear_jvp(lambda: prim, jvp, present)

    def abstract(*avals, batched, **params):
        args, flags, static = present(avals, batched, params)
        return pick(ffi_call.abstract(*args, batched=flags, **static))

    def lowering(ctx, *values, batched, **params):
        def call(*operands):
            args, flags, static = present(operands, batched, params)
            return pick(ffi_call.lowered(ctx, len(args), flags, static)(*args))

        return mlir.lower_fun(call, multiple_results=multiple_results)(ctx, *values)

    prim = primitive(name, lowering, abstract, jvp, transpose, multiple_results)
    return prim


def _present(optional, operands, batched, params):
    """The operands an FFI call takes, their batch flags and its static arguments."""
    if optional is None:
        return operands, batched, params
    n = len(operands) - (not params[optional])
    return operands[:n], batched[:n], {k: v for k, v in params.items() if k != optional}


def _multilinear_jvp(get_prim, linear, present):
    """The jvp of a primitive linear in each operand of ``linear`` separately."""

    def jvp(primals, tangents, *, batched, **params):
        prim = get_prim()
        out = prim.bind(*primals, batched=batched, **params)
        taken = present(tuple(range(len(primals))), batched, params)[0]
        terms = [prim.bind(*primals[:i], tangents[i], *primals[i + 1:], batched=batched, **params)
                 for i in linear if i in taken and not is_zero(tangents[i])]
        return out, sum_terms(terms, aval_of(out))

    return jvp


class GroupgemmPrimitive(Primitive):
    """A primitive whose ``batched`` parameter defaults to no operand batched: callers
    outside the batching rules bind it with its operands and static parameters only."""

    def bind(self, *operands, batched=None, **params):
        return super().bind(*operands, batched=(False,) * len(operands) if batched is None else batched, **params)


def primitive(name, lowering, abstract, jvp, transpose, multiple_results):
    """A primitive lowered by ``lowering`` (to FFI calls, or other primitives), with the
    batching rule every groupgemm primitive has: one bind for the whole batch, the
    ``batched`` parameter flagging the operands that carry it (an FFI call maps over it on
    each device, so a sharded batch axis stays where it is)."""

    def vmapped(args, dims, *, batched, **params):
        if any(batched):  # vmapped again: one call per entry of the new axis
            mapped = [i for i, d in enumerate(dims) if d is not None]

            def one(xs):
                full = list(args)
                for i, x in zip(mapped, xs):
                    full[i] = x
                return prim.bind(*full, batched=batched, **params)

            out = map_leading(one, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped])
            return out, [0] * len(out) if multiple_results else 0
        args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        flags = tuple(d is not None for d in dims)
        out = prim.bind(*args, batched=flags, **params)
        # A result carries the batch axis unless no term of it reads a batched operand (a
        # tangent along an unbatched direction): its rank against one entry's tells.
        entry = [jax.core.ShapedArray(a.shape[1:] if f else a.shape, a.dtype) for a, f in zip(args, flags)]
        entry_out, _ = prim.abstract_eval(*entry, batched=(False,) * len(args), **params)
        outs, entry_outs = (out, entry_out) if multiple_results else ((out,), (entry_out,))
        out_dims = [0 if o.ndim > e.ndim else None for o, e in zip(outs, entry_outs)]
        return out, out_dims if multiple_results else out_dims[0]

    prim = GroupgemmPrimitive(name)
    prim.multiple_results = multiple_results
    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, lowering)
    lowers_to_partitioned_calls(prim)
    ad.primitive_jvps[prim] = jvp
    if transpose is not None:
        ad.primitive_transposes[prim] = transpose
    batching.primitive_batchers[prim] = vmapped
    return prim


# ---- matmul ---------------------------------------------------------------------------


def bias_rows(bias, sizes, offset, *, num_rows, transpose_rhs, out_dtype, batched=(False,) * 3):
    """``out[r] = bias[g]`` for the rows of each group, exact zeros elsewhere: a K = 0
    matmul. ``batched`` flags bias, sizes and offset."""
    g, n = bias.shape[-2:]
    rhs = jnp.zeros((g, n, 0) if transpose_rhs else (g, 0, n), bias.dtype)
    bias_b, sizes_b, offset_b = batched
    return matmul_p.bind(jnp.zeros((num_rows, 0), bias.dtype), rhs, sizes, offset, bias, transpose_rhs=transpose_rhs,
                         out_dtype=out_dtype, has_bias=True, batched=(False, False, sizes_b, offset_b, bias_b))


def _matmul_jvp(primals, tangents, *, batched, transpose_rhs, out_dtype, has_bias):
    lhs, rhs, sizes, offset, bias = primals
    t_lhs, t_rhs, _, _, t_bias = tangents
    out = matmul_p.bind(*primals, batched=batched, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                        has_bias=has_bias)
    present = (not is_zero(t_lhs), not is_zero(t_rhs), has_bias and not is_zero(t_bias))
    if not any(present):
        return out, zero_tangent(aval_of(out))
    none = placeholder(lhs.dtype)
    tangent = matmul_tangent_p.bind(
        *(t if p else none for t, p in zip((t_lhs, t_rhs, t_bias), present)), lhs, rhs, sizes, offset,
        transpose_rhs=transpose_rhs, out_dtype=out_dtype, has_t_lhs=present[0], has_t_rhs=present[1],
        has_t_bias=present[2], batched=(batched[0] and present[0], batched[1] and present[1],
                                        batched[4] and present[2], *batched[:4]))
    return out, typed_like(tangent, aval_of(out))


def _matmul_transpose(ct, lhs, rhs, sizes, offset, bias, *, transpose_rhs, out_dtype, has_bias, batched):
    results = [None] * 5
    if is_zero(ct):
        return results
    lhs_b, rhs_b, sizes_b, offset_b, bias_b = batched
    out_b = any(batched)
    g = (rhs.aval if ad.is_undefined_primal(rhs) else rhs).shape[1 if rhs_b else 0]
    if ad.is_undefined_primal(lhs):
        dtype = lhs.aval.dtype
        # The core multiplies operands of one dtype: a wider cotangent is rounded once.
        flags = (out_b, rhs_b, sizes_b, offset_b, False)
        dlhs = matmul_p.bind(ct.astype(dtype), rhs, sizes, offset, placeholder(dtype),
                             transpose_rhs=not transpose_rhs, out_dtype=dtype, has_bias=False, batched=flags)
        results[0] = cotangent(dlhs, lhs, lhs_b, any(flags))
    if ad.is_undefined_primal(rhs):
        dtype = rhs.aval.dtype
        a, b = (ct.astype(dtype), lhs) if transpose_rhs else (lhs, ct.astype(dtype))  # rhs [G,N,K] or [G,K,N]
        a_b, b_b = (out_b, lhs_b) if transpose_rhs else (lhs_b, out_b)
        flags = (a_b, b_b, sizes_b, offset_b, False)
        drhs = wgrad_p.bind(a, b, sizes, offset, placeholder(dtype), num_groups=g, out_dtype=dtype,
                            accumulate=False, batched=flags)
        results[1] = cotangent(drhs, rhs, rhs_b, any(flags))
    if has_bias and ad.is_undefined_primal(bias):
        dtype = bias.aval.dtype
        flags = (out_b, sizes_b, offset_b)
        dbias = bias_grad_p.bind(ct.astype(dtype), sizes, offset, num_groups=g, out_dtype=dtype, batched=flags)
        results[4] = cotangent(dbias, bias, bias_b, any(flags))
    return results


matmul_p = define("groupgemm_matmul", ffi_calls.matmul, "has_bias", _matmul_jvp, _matmul_transpose)


# ---- the matmul's tangent, whose transpose is the backward ----------------------------------
# matmul_tangent_p(t_lhs, t_rhs, t_bias; lhs, rhs) = matmul(t_lhs, rhs) + matmul(lhs, t_rhs)
# + bias_rows(t_bias), jointly linear in its tangents: reverse mode transposes it once, with
# every cotangent wanted, into backward_p, one core call for dlhs, drhs and dbias (the bits
# of the three separate calls). Absent tangents are flagged placeholders.


def _tangent_terms(t_lhs, t_rhs, t_bias, lhs, rhs, sizes, offset, *, transpose_rhs, out_dtype, has_t_lhs,
                   has_t_rhs, has_t_bias, batched):
    """The matmul_p binds the tangent sums, in order, as (operands, params) pairs."""
    b_tlhs, b_trhs, b_tbias, b_lhs, b_rhs, b_sizes, b_offset = batched
    linear = dict(transpose_rhs=transpose_rhs, out_dtype=out_dtype, has_bias=False)
    # Structs, not arrays: the abstract rule reads these terms too, and an abstract rule may
    # make no array (jax 0.11 has no trace to bind jnp.zeros's primitive to there).
    no_bias = jax.ShapeDtypeStruct((0,), lhs.dtype)
    terms = []
    if has_t_lhs:
        terms.append(((t_lhs, rhs, sizes, offset, no_bias),
                      dict(linear, batched=(b_tlhs, b_rhs, b_sizes, b_offset, False))))
    if has_t_rhs:
        terms.append(((lhs, t_rhs, sizes, offset, no_bias),
                      dict(linear, batched=(b_lhs, b_trhs, b_sizes, b_offset, False))))
    if has_t_bias:  # bias_rows: a K = 0 matmul
        g, n = t_bias.shape[-2:]
        x = jax.ShapeDtypeStruct((lhs.shape[1 if b_lhs else 0], 0), t_bias.dtype)
        w = jax.ShapeDtypeStruct((g, n, 0) if transpose_rhs else (g, 0, n), t_bias.dtype)
        terms.append(((x, w, sizes, offset, t_bias),
                      dict(linear, has_bias=True, batched=(False, False, b_sizes, b_offset, b_tbias))))
    return terms


def _zeros_for(x):
    return jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x


def _tangent_call(*operands, **params):
    terms = [matmul_p.bind(*map(_zeros_for, ops), **p) for ops, p in _tangent_terms(*operands, **params)]
    return functools.reduce(jnp.add, terms)


def _tangent_abstract(*avals, **params):
    """The sum of the terms' abstract values: a batched one where any term reads a batched
    operand (the sum broadcasts the others)."""
    def term(ops, p):
        p = dict(p)
        args, flags, static = _present("has_bias", [core_aval(x) for x in ops], p.pop("batched"), p)
        return ffi_calls.matmul.abstract(*args, batched=flags, **static)[0]

    return max((term(*t) for t in _tangent_terms(*avals, **params)), key=lambda a: a.ndim)


def core_aval(x):
    """An abstract value of an abstract value or a shape-and-dtype struct."""
    return jax.core.ShapedArray(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x


def _tangent_jvp(primals, tangents, *, batched, **params):
    """Linear in the tangents, bilinear with lhs and rhs: d(t_lhs @ rhs) = dt_lhs @ rhs + t_lhs @ d_rhs."""
    t_lhs, t_rhs, t_bias, lhs, rhs, sizes, offset = primals
    dt_lhs, dt_rhs, dt_bias, d_lhs, d_rhs, _, _ = tangents
    out = matmul_tangent_p.bind(*primals, batched=batched, **params)
    b_tlhs, b_trhs, b_tbias, b_lhs, b_rhs, b_sizes, b_offset = batched
    linear = dict(transpose_rhs=params["transpose_rhs"], out_dtype=params["out_dtype"], has_bias=False)
    none = placeholder(lhs.dtype)
    present = (params["has_t_lhs"] and not is_zero(dt_lhs), params["has_t_rhs"] and not is_zero(dt_rhs),
               params["has_t_bias"] and not is_zero(dt_bias))
    terms = [
        matmul_tangent_p.bind(*(d if p else none for d, p in zip((dt_lhs, dt_rhs, dt_bias), present)), lhs, rhs,
                              sizes, offset, batched=(b_tlhs and present[0], b_trhs and present[1],
                                                      b_tbias and present[2], b_lhs, b_rhs, b_sizes, b_offset),
                              **dict(params, has_t_lhs=present[0], has_t_rhs=present[1], has_t_bias=present[2]))
        if any(present) else None,
        matmul_p.bind(t_lhs, d_rhs, sizes, offset, none, batched=(b_tlhs, b_rhs, b_sizes, b_offset, False), **linear)
        if params["has_t_lhs"] and not is_zero(d_rhs) else None,
        matmul_p.bind(d_lhs, t_rhs, sizes, offset, none, batched=(b_lhs, b_trhs, b_sizes, b_offset, False), **linear)
        if params["has_t_rhs"] and not is_zero(d_lhs) else None,
    ]
    return out, sum_terms(terms, aval_of(out))


def _tangent_transpose(ct, t_lhs, t_rhs, t_bias, lhs, rhs, sizes, offset, *, transpose_rhs, out_dtype, has_t_lhs,
                       has_t_rhs, has_t_bias, batched):
    if ad.is_undefined_primal(lhs) or ad.is_undefined_primal(rhs):
        raise NotImplementedError("groupgemm: the matmul tangent is linear in its tangents only")
    want = (has_t_lhs and ad.is_undefined_primal(t_lhs), has_t_rhs and ad.is_undefined_primal(t_rhs),
            has_t_bias and ad.is_undefined_primal(t_bias))
    if is_zero(ct) or not any(want):
        return [None] * 7
    b_tlhs, b_trhs, b_tbias, b_lhs, b_rhs, b_sizes, b_offset = batched
    ct_b = any(batched)
    # The core multiplies operands of one dtype: a wider cotangent is rounded once.
    grads = backward_p.bind(ct.astype(lhs.dtype), lhs, rhs, sizes, offset, transpose_rhs=transpose_rhs,
                            want_dlhs=want[0], want_drhs=want[1], want_dbias=want[2],
                            dbias_dtype=np.dtype(t_bias.aval.dtype if want[2] else lhs.dtype),
                            batched=(ct_b, b_lhs, b_rhs, b_sizes, b_offset))
    out_b = ct_b or b_lhs or b_rhs or b_sizes or b_offset
    return [cotangent(g, operand, operand_b, out_b) if w else None
            for g, w, operand, operand_b in zip(grads, want, (t_lhs, t_rhs, t_bias), (b_tlhs, b_trhs, b_tbias))] \
        + [None] * 4


matmul_tangent_p = primitive("groupgemm_matmul_tangent", mlir.lower_fun(_tangent_call, multiple_results=False),
                              _tangent_abstract, _tangent_jvp, _tangent_transpose, multiple_results=False)


def _backward_jvp(primals, tangents, *, batched, transpose_rhs, want_dlhs, want_drhs, want_dbias, dbias_dtype):
    """The three gradients are bilinear in (grad, rhs) and (grad, lhs): their tangents are
    the separate calls on the tangents."""
    grad, lhs, rhs, sizes, offset = primals
    t_grad, t_lhs, t_rhs, _, _ = tangents
    b_grad, b_lhs, b_rhs, b_sizes, b_offset = batched
    outs = backward_p.bind(*primals, batched=batched, transpose_rhs=transpose_rhs, want_dlhs=want_dlhs,
                           want_drhs=want_drhs, want_dbias=want_dbias, dbias_dtype=dbias_dtype)
    none = placeholder(lhs.dtype)
    g = rhs.shape[1 if b_rhs else 0]
    product = dict(transpose_rhs=not transpose_rhs, out_dtype=lhs.dtype, has_bias=False)
    t_dlhs = [None if is_zero(t_grad) else matmul_p.bind(t_grad, rhs, sizes, offset, none, **product,
                                                          batched=(b_grad, b_rhs, b_sizes, b_offset, False)),
              None if is_zero(t_rhs) else matmul_p.bind(grad, t_rhs, sizes, offset, none, **product,
                                                         batched=(b_grad, b_rhs, b_sizes, b_offset, False))]

    def wgrad(a, b, a_b, b_b):  # rhs [G, N, K]: grad^T @ lhs; [G, K, N]: lhs^T @ grad
        a, b, a_b, b_b = (b, a, b_b, a_b) if transpose_rhs else (a, b, a_b, b_b)
        return wgrad_p.bind(a, b, sizes, offset, placeholder(rhs.dtype), num_groups=g, out_dtype=rhs.dtype,
                            accumulate=False, batched=(a_b, b_b, b_sizes, b_offset, False))

    t_drhs = [None if is_zero(t_lhs) else wgrad(t_lhs, grad, b_lhs, b_grad),
              None if is_zero(t_grad) else wgrad(lhs, t_grad, b_lhs, b_grad)]
    t_dbias = [None if is_zero(t_grad) else bias_grad_p.bind(t_grad.astype(dbias_dtype), sizes, offset,
                                                               num_groups=g, out_dtype=dbias_dtype,
                                                               batched=(b_grad, b_sizes, b_offset))]
    tangents_out = [sum_terms(terms, aval_of(out)) if wanted else zero_tangent(aval_of(out))
                    for terms, wanted, out in zip((t_dlhs, t_drhs, t_dbias), (want_dlhs, want_drhs, want_dbias), outs)]
    return outs, tangents_out


backward_p = define("groupgemm_matmul_backward", ffi_calls.matmul_backward, None, _backward_jvp,
                    multiple_results=True)


# ---- wgrad ----------------------------------------------------------------------------


def _wgrad_jvp(primals, tangents, *, batched, **params):
    lhs, grad, sizes, offset, acc = primals
    t_lhs, t_grad, _, _, t_acc = tangents
    out = wgrad_p.bind(*primals, batched=batched, **params)
    product = dict(params, accumulate=False, batched=batched[:4] + (False,))
    none = placeholder(params["out_dtype"])
    terms = [
        None if is_zero(t_lhs) else wgrad_p.bind(t_lhs, grad, sizes, offset, none, **product),
        None if is_zero(t_grad) else wgrad_p.bind(lhs, t_grad, sizes, offset, none, **product),
        None if not params["accumulate"] or is_zero(t_acc) else t_acc,
    ]
    return out, sum_terms(terms, aval_of(out))


def _wgrad_transpose(ct, lhs, grad, sizes, offset, acc, *, num_groups, out_dtype, accumulate, batched):
    results = [None] * 5
    if is_zero(ct):
        return results
    lhs_b, grad_b, sizes_b, offset_b, acc_b = batched
    out_b = any(batched)
    if ad.is_undefined_primal(lhs):  # d lhs[r] = grad[r] @ ct[g]^T
        dtype = lhs.aval.dtype
        flags = (grad_b, out_b, sizes_b, offset_b, False)
        dlhs = matmul_p.bind(grad, ct.astype(dtype), sizes, offset, placeholder(dtype), transpose_rhs=True,
                             out_dtype=dtype, has_bias=False, batched=flags)
        results[0] = cotangent(dlhs, lhs, lhs_b, any(flags))
    if ad.is_undefined_primal(grad):  # d grad[r] = lhs[r] @ ct[g]
        dtype = grad.aval.dtype
        flags = (lhs_b, out_b, sizes_b, offset_b, False)
        dgrad = matmul_p.bind(lhs, ct.astype(dtype), sizes, offset, placeholder(dtype), transpose_rhs=False,
                              out_dtype=dtype, has_bias=False, batched=flags)
        results[1] = cotangent(dgrad, grad, grad_b, any(flags))
    if accumulate and ad.is_undefined_primal(acc):
        results[4] = cotangent(ct.astype(acc.aval.dtype), acc, acc_b, out_b)
    return results


wgrad_p = define("groupgemm_wgrad", ffi_calls.wgrad, "accumulate", _wgrad_jvp, _wgrad_transpose)


# ---- bias_grad ------------------------------------------------------------------------


def _bias_grad_transpose(ct, grad, sizes, offset, *, num_groups, out_dtype, batched):
    if is_zero(ct) or not ad.is_undefined_primal(grad):
        return [None] * 3
    grad_b, sizes_b, offset_b = batched
    dtype = grad.aval.dtype
    num_rows = grad.aval.shape[1 if grad_b else 0]
    rows = bias_rows(ct.astype(dtype), sizes, offset, num_rows=num_rows, transpose_rhs=False, out_dtype=dtype,
                     batched=(any(batched), sizes_b, offset_b))
    return [cotangent(rows, grad, grad_b, any(batched)), None, None]


bias_grad_p = define("groupgemm_bias_grad", ffi_calls.bias_grad, None, (0,), _bias_grad_transpose)
