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
"""

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from groupgemm.jax_ext import raw


def placeholder(dtype):
    return jnp.zeros((0,), dtype)


def varying_count(aval):
    manual = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
    return len(getattr(manual, "varying", ())) if manual is not None else len(getattr(aval, "vma", ()))


def result(shape, dtype, *operands):
    """The result's abstract value: typed like the operand that varies along the most
    shard_map axes (the frontends give all differentiable operands the same ones)."""
    widest = max(operands, key=varying_count)
    return widest.update(shape=shape, dtype=dtype, weak_type=False)


def aval_of(x):
    return jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)


def is_zero(t):
    return type(t) is ad.Zero


def sum_terms(terms, aval):
    terms = [t for t in terms if t is not None]
    return functools.reduce(jnp.add, terms) if terms else ad.Zero(aval.to_tangent_aval())


def _sequential(prim):
    """vmap: one call per batch element (lax.map), unbatched operands shared."""

    def rule(args, dims, **params):
        mapped = [i for i, d in enumerate(dims) if d is not None]  # None: not batched

        def one(xs):
            full = list(args)
            for i, x in zip(mapped, xs):
                full[i] = x
            return prim.bind(*full, **params)

        out = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped])
        return out, [0] * len(out) if prim.multiple_results else 0

    return rule


def define(name, call, abstract_eval, jvp, transpose=None, *, multiple_results=False):
    """A primitive lowered to `call` (the FFI calls of raw.py or expert_raw.py), with its
    JVP rule, its transpose rule (linear primitives) and a sequential batching rule."""
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(call)  # eager: the FFI call itself
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(call, multiple_results=multiple_results))
    ad.primitive_jvps[prim] = jvp
    if transpose is not None:
        ad.primitive_transposes[prim] = transpose
    batching.primitive_batchers[prim] = _sequential(prim)
    return prim


# ---- matmul ---------------------------------------------------------------------------


def _matmul_abstract(lhs, rhs, sizes, offset, bias, *, transpose_rhs, out_dtype, has_bias):
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return result((lhs.shape[0], n), out_dtype, lhs, rhs, bias)


def bias_rows(bias, sizes, offset, *, num_rows, transpose_rhs, out_dtype):
    """``out[r] = bias[g]`` for the rows of each group, exact zeros elsewhere: a K = 0 matmul."""
    g, n = bias.shape
    rhs = jnp.zeros((g, n, 0) if transpose_rhs else (g, 0, n), bias.dtype)
    return matmul_p.bind(jnp.zeros((num_rows, 0), bias.dtype), rhs, sizes, offset, bias, transpose_rhs=transpose_rhs,
                         out_dtype=out_dtype, has_bias=True)


def _matmul_jvp(primals, tangents, **params):
    lhs, rhs, sizes, offset, bias = primals
    t_lhs, t_rhs, _, _, t_bias = tangents
    out = matmul_p.bind(*primals, **params)
    linear = dict(params, has_bias=False)
    none = placeholder(lhs.dtype)
    terms = [
        None if is_zero(t_lhs) else matmul_p.bind(t_lhs, rhs, sizes, offset, none, **linear),
        None if is_zero(t_rhs) else matmul_p.bind(lhs, t_rhs, sizes, offset, none, **linear),
        None if not params["has_bias"] or is_zero(t_bias) else bias_rows(
            t_bias, sizes, offset, num_rows=lhs.shape[0], transpose_rhs=params["transpose_rhs"],
            out_dtype=params["out_dtype"]),
    ]
    return out, sum_terms(terms, aval_of(out))


def _matmul_transpose(ct, lhs, rhs, sizes, offset, bias, *, transpose_rhs, out_dtype, has_bias):
    results = [None] * 5
    if is_zero(ct):
        return results
    g = (rhs.aval if ad.is_undefined_primal(rhs) else rhs).shape[0]
    if ad.is_undefined_primal(lhs):
        dtype = lhs.aval.dtype
        # The core multiplies operands of one dtype: a wider cotangent is rounded once.
        results[0] = matmul_p.bind(ct.astype(dtype), rhs, sizes, offset, placeholder(dtype),
                                   transpose_rhs=not transpose_rhs, out_dtype=dtype, has_bias=False)
    if ad.is_undefined_primal(rhs):
        dtype = rhs.aval.dtype
        a, b = (ct.astype(dtype), lhs) if transpose_rhs else (lhs, ct.astype(dtype))  # rhs [G,N,K] or [G,K,N]
        results[1] = wgrad_p.bind(a, b, sizes, offset, placeholder(dtype), num_groups=g, out_dtype=dtype,
                                  accumulate=False)
    if has_bias and ad.is_undefined_primal(bias):
        dtype = bias.aval.dtype
        results[4] = bias_grad_p.bind(ct.astype(dtype), sizes, offset, num_groups=g, out_dtype=dtype)
    return results


def _matmul_call(lhs, rhs, sizes, offset, bias, *, transpose_rhs, out_dtype, has_bias):
    return raw.matmul(lhs, rhs, sizes, offset, bias if has_bias else None, transpose_rhs=transpose_rhs,
                      out_dtype=out_dtype)


matmul_p = define("groupgemm_matmul", _matmul_call, _matmul_abstract, _matmul_jvp, _matmul_transpose)


# ---- wgrad ----------------------------------------------------------------------------


def _wgrad_abstract(lhs, grad, sizes, offset, acc, *, num_groups, out_dtype, accumulate):
    return result((num_groups, lhs.shape[1], grad.shape[1]), out_dtype, lhs, grad, acc)


def _wgrad_jvp(primals, tangents, **params):
    lhs, grad, sizes, offset, acc = primals
    t_lhs, t_grad, _, _, t_acc = tangents
    out = wgrad_p.bind(*primals, **params)
    product = dict(params, accumulate=False)
    none = placeholder(params["out_dtype"])
    terms = [
        None if is_zero(t_lhs) else wgrad_p.bind(t_lhs, grad, sizes, offset, none, **product),
        None if is_zero(t_grad) else wgrad_p.bind(lhs, t_grad, sizes, offset, none, **product),
        None if not params["accumulate"] or is_zero(t_acc) else t_acc,
    ]
    return out, sum_terms(terms, aval_of(out))


def _wgrad_transpose(ct, lhs, grad, sizes, offset, acc, *, num_groups, out_dtype, accumulate):
    results = [None] * 5
    if is_zero(ct):
        return results
    if ad.is_undefined_primal(lhs):  # d lhs[r] = grad[r] @ ct[g]^T
        dtype = lhs.aval.dtype
        results[0] = matmul_p.bind(grad, ct.astype(dtype), sizes, offset, placeholder(dtype), transpose_rhs=True,
                                   out_dtype=dtype, has_bias=False)
    if ad.is_undefined_primal(grad):  # d grad[r] = lhs[r] @ ct[g]
        dtype = grad.aval.dtype
        results[1] = matmul_p.bind(lhs, ct.astype(dtype), sizes, offset, placeholder(dtype), transpose_rhs=False,
                                   out_dtype=dtype, has_bias=False)
    if accumulate and ad.is_undefined_primal(acc):
        results[4] = ct.astype(acc.aval.dtype)
    return results


def _wgrad_call(lhs, grad, sizes, offset, acc, *, num_groups, out_dtype, accumulate):
    return raw.wgrad(lhs, grad, sizes, offset, acc if accumulate else None, num_groups=num_groups,
                     out_dtype=out_dtype)


wgrad_p = define("groupgemm_wgrad", _wgrad_call, _wgrad_abstract, _wgrad_jvp, _wgrad_transpose)


# ---- bias_grad ------------------------------------------------------------------------


def _bias_grad_abstract(grad, sizes, offset, *, num_groups, out_dtype):
    return result((num_groups, grad.shape[1]), out_dtype, grad)


def _bias_grad_jvp(primals, tangents, **params):
    grad, sizes, offset = primals
    out = bias_grad_p.bind(*primals, **params)
    t = tangents[0]
    return out, sum_terms([None if is_zero(t) else bias_grad_p.bind(t, sizes, offset, **params)],
                     aval_of(out))


def _bias_grad_transpose(ct, grad, sizes, offset, *, num_groups, out_dtype):
    if is_zero(ct) or not ad.is_undefined_primal(grad):
        return [None] * 3
    dtype = grad.aval.dtype
    return [bias_rows(ct.astype(dtype), sizes, offset, num_rows=grad.aval.shape[0], transpose_rhs=False,
                      out_dtype=dtype), None, None]


def _bias_grad_call(grad, sizes, offset, *, num_groups, out_dtype):
    return raw.bias_grad(grad, sizes, offset, num_groups=num_groups, out_dtype=out_dtype)


bias_grad_p = define("groupgemm_bias_grad", _bias_grad_call, _bias_grad_abstract, _bias_grad_jvp,
                      _bias_grad_transpose)
