"""The grouped GEMMs as JAX primitives, so that every JAX transformation composes: jit,
vmap, forward and reverse mode to any order (jvp, vjp, jacfwd, jacrev, hessian,
linear_transpose).

Three primitives, each lowered to its XLA FFI call (raw.py):
- ``matmul_p``: ``out[r] = lhs[r] @ rhs[g] (+ bias[g])``, bilinear in (lhs, rhs), affine in bias;
- ``wgrad_p``: ``out[g] = lhs_g^T @ grad_g (+ acc[g])``, bilinear in (lhs, grad), affine in acc;
- ``bias_grad_p``: ``out[g] = sum of grad_g's rows``, linear in grad.
Their tangents and transposes are these same primitives on the same groups (the rows
past every group stay padding throughout), so a gradient of any order keeps the exact
zeros of the first, and the first-order gradients are the very calls the PyTorch
frontend makes (same bits). An absent bias or accumulator is a size-0 placeholder.

Each lowers to its raw call, partitioned under jit with sharded operands (partitioning.py).
The ``batched`` parameter flags the operands that carry a leading vmapped axis: vmap binds
the primitive once for the whole batch (the raw call maps over it on each device, so a
sharded batch axis stays where it is), and a transpose sums the cotangent of an operand
without that axis over it.
"""

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from groupgemm.jax_ext import raw
from groupgemm.jax_ext.partitioning import lowers_to_partitioned_calls, typed_like


def placeholder(dtype):
    return jnp.zeros((0,), dtype)


def _aval(x):
    return jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)


def _is_zero(t):
    return type(t) is ad.Zero


def _sum(terms, aval):
    terms = [typed_like(t, aval) for t in terms if t is not None]
    return functools.reduce(jnp.add, terms) if terms else ad.Zero(aval.to_tangent_aval())


def _cotangent(x, operand, operand_batched, result_batched):
    """The cotangent of an undefined ``operand``: summed over the vmapped axis the operand
    lacks, typed like the operand on a mesh with explicit axes."""
    return typed_like(x.sum(0) if result_batched and not operand_batched else x, operand.aval)


def _define(name, raw_call, present, jvp, transpose):
    """A primitive lowered to the partitioned raw call; ``present(*operands, **params)`` picks
    the operands the raw call takes (an absent bias or accumulator is left out) and its
    static arguments."""

    def call(*operands, batched, **params):
        args, flags, static = present(operands, batched, params)
        return raw_call(*args, batched=flags, **static)[0]

    def abstract(*avals, batched, **params):
        args, flags, static = present(avals, batched, params)
        return raw_call.abstract(*args, batched=flags, **static)[0]

    def vmapped(args, dims, *, batched, **params):
        if any(batched):  # vmapped again: one call per entry of the new axis
            mapped = [i for i, d in enumerate(dims) if d is not None]

            def one(xs):
                full = list(args)
                for i, x in zip(mapped, xs):
                    full[i] = x
                return prim.bind(*full, batched=batched, **params)

            return jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped]), 0
        args = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
        return prim.bind(*args, batched=tuple(d is not None for d in dims), **params), 0

    prim = Primitive(name)
    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, mlir.lower_fun(call, multiple_results=False))
    lowers_to_partitioned_calls(prim)
    ad.primitive_jvps[prim] = jvp
    ad.primitive_transposes[prim] = transpose
    batching.primitive_batchers[prim] = vmapped
    return prim


UNBATCHED = (False,) * 5


# ---- matmul ---------------------------------------------------------------------------


def _matmul_present(operands, batched, params):
    n = 5 if params["has_bias"] else 4
    return operands[:n], batched[:n], dict(transpose_rhs=params["transpose_rhs"], out_dtype=params["out_dtype"])


def bias_rows(bias, sizes, offset, *, num_rows, transpose_rhs, out_dtype, batched=(False,) * 3):
    """``out[r] = bias[g]`` for the rows of each group, exact zeros elsewhere: a K = 0
    matmul. ``batched`` flags bias, sizes and offset."""
    g, n = bias.shape[-2:]
    rhs = jnp.zeros((g, n, 0) if transpose_rhs else (g, 0, n), bias.dtype)
    bias_b, sizes_b, offset_b = batched
    return matmul_p.bind(jnp.zeros((num_rows, 0), bias.dtype), rhs, sizes, offset, bias, transpose_rhs=transpose_rhs,
                         out_dtype=out_dtype, has_bias=True, batched=(False, False, sizes_b, offset_b, bias_b))


def _matmul_jvp(primals, tangents, *, batched, **params):
    lhs, rhs, sizes, offset, bias = primals
    t_lhs, t_rhs, _, _, t_bias = tangents
    out = matmul_p.bind(*primals, batched=batched, **params)
    linear = dict(params, has_bias=False, batched=batched[:4] + (False,))
    none = placeholder(lhs.dtype)
    num_rows = lhs.shape[1 if batched[0] else 0]
    terms = [
        None if _is_zero(t_lhs) else matmul_p.bind(t_lhs, rhs, sizes, offset, none, **linear),
        None if _is_zero(t_rhs) else matmul_p.bind(lhs, t_rhs, sizes, offset, none, **linear),
        None if not params["has_bias"] or _is_zero(t_bias) else bias_rows(
            t_bias, sizes, offset, num_rows=num_rows, transpose_rhs=params["transpose_rhs"],
            out_dtype=params["out_dtype"], batched=(batched[4], batched[2], batched[3])),
    ]
    return out, _sum(terms, _aval(out))


def _matmul_transpose(ct, lhs, rhs, sizes, offset, bias, *, transpose_rhs, out_dtype, has_bias, batched):
    results = [None] * 5
    if _is_zero(ct):
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
        results[0] = _cotangent(dlhs, lhs, lhs_b, any(flags))
    if ad.is_undefined_primal(rhs):
        dtype = rhs.aval.dtype
        a, b = (ct.astype(dtype), lhs) if transpose_rhs else (lhs, ct.astype(dtype))  # rhs [G,N,K] or [G,K,N]
        a_b, b_b = (out_b, lhs_b) if transpose_rhs else (lhs_b, out_b)
        flags = (a_b, b_b, sizes_b, offset_b, False)
        drhs = wgrad_p.bind(a, b, sizes, offset, placeholder(dtype), num_groups=g, out_dtype=dtype,
                            accumulate=False, batched=flags)
        results[1] = _cotangent(drhs, rhs, rhs_b, any(flags))
    if has_bias and ad.is_undefined_primal(bias):
        dtype = bias.aval.dtype
        flags = (out_b, sizes_b, offset_b)
        dbias = bias_grad_p.bind(ct.astype(dtype), sizes, offset, num_groups=g, out_dtype=dtype, batched=flags)
        results[4] = _cotangent(dbias, bias, bias_b, any(flags))
    return results


matmul_p = _define("groupgemm_matmul", raw.matmul, _matmul_present, _matmul_jvp, _matmul_transpose)


# ---- wgrad ----------------------------------------------------------------------------


def _wgrad_present(operands, batched, params):
    n = 5 if params["accumulate"] else 4
    return operands[:n], batched[:n], dict(num_groups=params["num_groups"], out_dtype=params["out_dtype"])


def _wgrad_jvp(primals, tangents, *, batched, **params):
    lhs, grad, sizes, offset, acc = primals
    t_lhs, t_grad, _, _, t_acc = tangents
    out = wgrad_p.bind(*primals, batched=batched, **params)
    product = dict(params, accumulate=False, batched=batched[:4] + (False,))
    none = placeholder(params["out_dtype"])
    terms = [
        None if _is_zero(t_lhs) else wgrad_p.bind(t_lhs, grad, sizes, offset, none, **product),
        None if _is_zero(t_grad) else wgrad_p.bind(lhs, t_grad, sizes, offset, none, **product),
        None if not params["accumulate"] or _is_zero(t_acc) else t_acc,
    ]
    return out, _sum(terms, _aval(out))


def _wgrad_transpose(ct, lhs, grad, sizes, offset, acc, *, num_groups, out_dtype, accumulate, batched):
    results = [None] * 5
    if _is_zero(ct):
        return results
    lhs_b, grad_b, sizes_b, offset_b, acc_b = batched
    out_b = any(batched)
    if ad.is_undefined_primal(lhs):  # d lhs[r] = grad[r] @ ct[g]^T
        dtype = lhs.aval.dtype
        flags = (grad_b, out_b, sizes_b, offset_b, False)
        dlhs = matmul_p.bind(grad, ct.astype(dtype), sizes, offset, placeholder(dtype), transpose_rhs=True,
                             out_dtype=dtype, has_bias=False, batched=flags)
        results[0] = _cotangent(dlhs, lhs, lhs_b, any(flags))
    if ad.is_undefined_primal(grad):  # d grad[r] = lhs[r] @ ct[g]
        dtype = grad.aval.dtype
        flags = (lhs_b, out_b, sizes_b, offset_b, False)
        dgrad = matmul_p.bind(lhs, ct.astype(dtype), sizes, offset, placeholder(dtype), transpose_rhs=False,
                              out_dtype=dtype, has_bias=False, batched=flags)
        results[1] = _cotangent(dgrad, grad, grad_b, any(flags))
    if accumulate and ad.is_undefined_primal(acc):
        results[4] = _cotangent(ct.astype(acc.aval.dtype), acc, acc_b, out_b)
    return results


wgrad_p = _define("groupgemm_wgrad", raw.wgrad, _wgrad_present, _wgrad_jvp, _wgrad_transpose)


# ---- bias_grad ------------------------------------------------------------------------


def _bias_grad_present(operands, batched, params):
    return operands, batched, params


def _bias_grad_jvp(primals, tangents, *, batched, **params):
    grad, sizes, offset = primals
    out = bias_grad_p.bind(*primals, batched=batched, **params)
    t = tangents[0]
    return out, _sum([None if _is_zero(t) else bias_grad_p.bind(t, sizes, offset, batched=batched, **params)],
                     _aval(out))


def _bias_grad_transpose(ct, grad, sizes, offset, *, num_groups, out_dtype, batched):
    if _is_zero(ct) or not ad.is_undefined_primal(grad):
        return [None] * 3
    grad_b, sizes_b, offset_b = batched
    dtype = grad.aval.dtype
    num_rows = grad.aval.shape[1 if grad_b else 0]
    rows = bias_rows(ct.astype(dtype), sizes, offset, num_rows=num_rows, transpose_rhs=False, out_dtype=dtype,
                     batched=(any(batched), sizes_b, offset_b))
    return [_cotangent(rows, grad, grad_b, any(batched)), None, None]


bias_grad_p = _define("groupgemm_bias_grad", raw.bias_grad, _bias_grad_present, _bias_grad_jvp,
                      _bias_grad_transpose)
