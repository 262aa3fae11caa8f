"""The FP8 calls as JAX primitives over their FFI calls (fp8_raw.py), so jit, vmap and
sharding treat them like the grouped GEMMs' primitives:

- ``quantize_rows_p`` / ``quantize_blocks_p`` / ``quantize_grouped_p``: high precision ->
  (float8 values, float32 scales);
- ``scaled_matmul_p``: the forward / dgrad form, ``out[r] = lhs[r] @ rhs[g]^T`` scaled;
- ``scaled_wgrad_p``: the weight-gradient form, ``out[g] = lhs[:, rows_g] @ rhs[:, rows_g]^T``.

They have no derivative rules: float8 operands are quantized values, and the training
recipe (fp8_recipe.py) defines the derivative of the whole FP8 layer instead. Asking
for one raises, naming the primitive. An absent bias or accumulator is a size-0
placeholder.
"""

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from groupgemm import _contract as contract
from groupgemm.jax_ext import fp8_raw
from groupgemm.jax_ext.primitives import _result


def _batch_sequentially(prim):
    """vmap: one call per batch element (lax.map), unbatched operands shared."""

    def rule(args, dims, **params):
        mapped = [i for i, d in enumerate(dims) if d is not None]

        def one(xs):
            full = list(args)
            for i, x in zip(mapped, xs):
                full[i] = x
            return prim.bind(*full, **params)

        outs = jax.lax.map(one, [jnp.moveaxis(args[i], dims[i], 0) for i in mapped])
        return (outs, (0,) * len(outs)) if prim.multiple_results else (outs, 0)

    return rule


def _not_differentiable(name):
    def refuse(*_, **__):
        raise NotImplementedError(f"{name} is not differentiable: its float8 operands are quantized values. "
                                  "Differentiate through grouped_mlp(fp8=...), whose gradient runs the FP8 GEMMs "
                                  "of the gradients")

    return refuse


def _define(name, call, abstract_eval, multiple_results):
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(call)
    prim.def_abstract_eval(abstract_eval)
    mlir.register_lowering(prim, mlir.lower_fun(call, multiple_results=multiple_results))
    ad.primitive_jvps[prim] = _not_differentiable(name)
    batching.primitive_batchers[prim] = _batch_sequentially(prim)
    return prim


# ---- quantization ---------------------------------------------------------------------


def _quantize_rows_abstract(x, *, out_type, scaling, power_of_two):
    rows, cols = x.shape
    scale = (rows,) if scaling == 0 else (rows, contract.fp8_blocks(cols))
    return _result(x.shape, fp8_raw.FP8_JAX_DTYPES[out_type], x), _result(scale, jnp.float32, x)


def _quantize_rows_call(x, *, out_type, scaling, power_of_two):
    return fp8_raw.quantize_rows(x, out_type=out_type, scaling=scaling, power_of_two=power_of_two)


quantize_rows_p = _define("groupgemm_fp8_quantize_rows", _quantize_rows_call, _quantize_rows_abstract, True)


def _quantize_blocks_abstract(x, *, out_type, power_of_two):
    b, rows, cols = x.shape
    scale = (b, contract.fp8_blocks(rows), contract.fp8_blocks(cols))
    return _result(x.shape, fp8_raw.FP8_JAX_DTYPES[out_type], x), _result(scale, jnp.float32, x)


def _quantize_blocks_call(x, *, out_type, power_of_two):
    return fp8_raw.quantize_blocks(x, out_type=out_type, power_of_two=power_of_two)


quantize_blocks_p = _define("groupgemm_fp8_quantize_blocks", _quantize_blocks_call, _quantize_blocks_abstract, True)


def _quantize_grouped_abstract(x, sizes, offset, *, num_groups, out_type, scaling, power_of_two):
    m, c = x.shape
    rows = num_groups if scaling == 0 else contract.fp8_token_block_bound(m, num_groups)
    return (_result((c, m), fp8_raw.FP8_JAX_DTYPES[out_type], x, sizes, offset),
            _result((rows, c), jnp.float32, x, sizes, offset))


def _quantize_grouped_call(x, sizes, offset, *, num_groups, out_type, scaling, power_of_two):
    return fp8_raw.quantize_grouped(x, sizes, offset, num_groups=num_groups, out_type=out_type, scaling=scaling,
                                    power_of_two=power_of_two)


quantize_grouped_p = _define("groupgemm_fp8_quantize_grouped", _quantize_grouped_call, _quantize_grouped_abstract,
                             True)


# ---- scaled grouped GEMMs -------------------------------------------------------------


def _scaled_matmul_abstract(lhs, rhs, lhs_scale, rhs_scale, sizes, offset, bias, *, scaling, out_dtype, has_bias):
    return _result((lhs.shape[0], rhs.shape[1]), out_dtype, lhs, rhs, lhs_scale, rhs_scale, bias)


def _scaled_matmul_call(lhs, rhs, lhs_scale, rhs_scale, sizes, offset, bias, *, scaling, out_dtype, has_bias):
    return fp8_raw.scaled_matmul(lhs, rhs, lhs_scale, rhs_scale, sizes, offset, bias if has_bias else None,
                                 scaling=scaling, out_dtype=out_dtype)


scaled_matmul_p = _define("groupgemm_scaled_matmul", _scaled_matmul_call, _scaled_matmul_abstract, False)


def _scaled_wgrad_abstract(lhs, rhs, lhs_scale, rhs_scale, sizes, offset, acc, *, num_groups, scaling, out_dtype,
                           accumulate):
    return _result((num_groups, lhs.shape[0], rhs.shape[0]), out_dtype, lhs, rhs, lhs_scale, rhs_scale, acc)


def _scaled_wgrad_call(lhs, rhs, lhs_scale, rhs_scale, sizes, offset, acc, *, num_groups, scaling, out_dtype,
                       accumulate):
    return fp8_raw.scaled_wgrad(lhs, rhs, lhs_scale, rhs_scale, sizes, offset, acc if accumulate else None,
                                num_groups=num_groups, scaling=scaling, out_dtype=out_dtype)


scaled_wgrad_p = _define("groupgemm_scaled_wgrad", _scaled_wgrad_call, _scaled_wgrad_abstract, False)
