"""grouped_mlp(fp8=...): the FP8 training recipe (groupgemm/_fp8_recipe.py) as a
jax.custom_vjp over the FP8 primitives: the forward GEMM, and as its derivative the
input- and weight-gradient GEMMs in float8, the bias gradient from the core's bias
reduction. The same calls in the same order as PyTorch's GroupedLinear(fp8=...), so the
two give the same bits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _contract as contract
from groupgemm import _fp8_recipe as recipe_steps
from groupgemm.jax_ext import fp8_primitives as prims
from groupgemm.jax_ext import primitives
from groupgemm.jax_ext.arguments import dtype_name, index_operands, same_varying_axes, shape_and_dtype
from groupgemm.jax_ext.functional import NAMES


class _Ops:
    """The recipe's operations on JAX arrays (float8_e4m3fn throughout)."""

    @staticmethod
    def dtype(x):
        return x.dtype

    @staticmethod
    def transpose(w):
        return jnp.swapaxes(w, -2, -1)

    @staticmethod
    def quantize_rows(x, recipe):
        return tuple(prims.quantize_rows_p.bind(x, out_type=recipe_steps.FP8_E4M3,
                                                scaling=contract.fp8_recipe(recipe, "fp8"), power_of_two=False,
                                                row_dims=1))

    @staticmethod
    def quantize_weight(w, recipe):
        if recipe == "blockwise":
            return tuple(prims.quantize_blocks_p.bind(w, out_type=recipe_steps.FP8_E4M3, power_of_two=False))
        return tuple(prims.quantize_rows_p.bind(w, out_type=recipe_steps.FP8_E4M3, scaling=contract.FP8_ROWWISE,
                                                power_of_two=False, row_dims=2))

    @staticmethod
    def quantize_grouped(x, group_sizes, group_offset, num_groups, recipe):
        return tuple(prims.quantize_grouped_p.bind(x, group_sizes, group_offset, num_groups=num_groups,
                                                   out_type=recipe_steps.FP8_E4M3,
                                                   scaling=contract.fp8_recipe(recipe, "fp8"), power_of_two=False))

    @staticmethod
    def scaled_mm(q, qw, s, sw, group_sizes, group_offset, bias, recipe, dtype):
        return prims.scaled_matmul_p.bind(q, qw, s, sw, group_sizes, group_offset,
                                          primitives.placeholder(dtype) if bias is None else bias,
                                          scaling=contract.fp8_recipe(recipe, "fp8"), out_dtype=np.dtype(dtype),
                                          has_bias=bias is not None)

    @staticmethod
    def scaled_wgrad(a, b, sa, sb, group_sizes, group_offset, num_groups, recipe, dtype, accumulate_into):
        # JAX gradients are values, added by the caller: the recipe never passes an
        # in-place accumulator here (PyTorch's main_grad does).
        assert accumulate_into is None
        return prims.scaled_wgrad_p.bind(a, b, sa, sb, group_sizes, group_offset, primitives.placeholder(dtype),
                                         num_groups=num_groups, scaling=contract.fp8_recipe(recipe, "fp8"),
                                         out_dtype=np.dtype(dtype), accumulate=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def fp8_grouped_matmul(x, weight, group_sizes, group_offset, bias, recipe, transpose_rhs):
    """``out[r] = x[r] @ weight[g] (+ bias[g])`` with the GEMMs of the recipe; weight
    ``[G, K, N]``, or ``[G, N, K]`` with transpose_rhs (checked by the caller). bias is None
    or ``[G, N]`` in x's dtype."""
    return recipe_steps.forward(_Ops, x, weight, group_sizes, group_offset, bias, recipe, transpose_rhs)


def _fwd(x, weight, group_sizes, group_offset, bias, recipe, transpose_rhs):
    out = fp8_grouped_matmul(x, weight, group_sizes, group_offset, bias, recipe, transpose_rhs)
    return out, (x, weight, group_sizes, group_offset, bias)


def _bwd(recipe, transpose_rhs, residuals, dout):
    """Each gradient typed like its primal (on a mesh with explicit axes, its sharding)."""
    x, weight, group_sizes, group_offset, bias = residuals
    dout = dout.astype(x.dtype)  # a wider cotangent is rounded once, as for the 16-bit GEMMs
    g = weight.shape[0]
    dx = recipe_steps.input_grad(_Ops, dout, weight, group_sizes, group_offset, recipe, transpose_rhs, x.dtype)
    dweight = recipe_steps.weight_grad(_Ops, x, dout, group_sizes, group_offset, g, recipe, transpose_rhs,
                                       weight.dtype)
    dbias = None if bias is None else primitives.typed_like(primitives.bias_grad_p.bind(
        dout.astype(bias.dtype), group_sizes, group_offset, num_groups=g, out_dtype=np.dtype(bias.dtype)), bias.aval)
    return primitives.typed_like(dx, x.aval), primitives.typed_like(dweight, weight.aval), None, None, dbias


fp8_grouped_matmul.defvjp(_fwd, _bwd)


def checked_fp8_grouped_matmul(x, weight, group_sizes, *, bias, transpose_rhs, group_offset, recipe, fn):
    """grouped_matmul's checks and operands, then fp8_grouped_matmul (grouped_mlp's layers)."""
    transpose_rhs = contract.static_flag(transpose_rhs, "transpose_rhs", fn)
    num_groups, n, _ = contract.matmul(fn, NAMES, shape_and_dtype(x), shape_and_dtype(weight), transpose_rhs,
                                       None if bias is None else shape_and_dtype(bias))
    contract.fp8_layer(fn, recipe, dtype_name(x.dtype), x.shape[1], n)
    group_sizes, group_offset = index_operands(group_sizes, group_offset, num_groups, x.shape[0], fn)
    x, weight, bias = same_varying_axes((x, weight, bias), (group_sizes, group_offset))
    return fp8_grouped_matmul(x, weight, group_sizes, group_offset, bias, recipe, transpose_rhs)
