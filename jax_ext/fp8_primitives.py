"""The FP8 calls as JAX primitives over their partitioned FFI calls (fp8_ffi_calls.py), made
like the grouped GEMMs' (primitives.py's ``define``), so jit, vmap and sharding treat them
alike:

- ``quantize_rows_p`` / ``quantize_blocks_p`` / ``quantize_grouped_p``: high precision ->
  (float8 values, float32 scales);
- ``scaled_matmul_p``: the forward / dgrad form, ``out[r] = lhs[r] @ rhs[g]^T`` scaled;
- ``scaled_wgrad_p``: the weight-gradient form, ``out[g] = lhs[:, rows_g] @ rhs[:, rows_g]^T``.

Each takes the ``batched`` parameter of every groupgemm primitive (the operands that carry
a leading vmapped axis). They have no derivative rules: float8 operands are quantized
values, and the training recipe (fp8_recipe.py) defines the derivative of the whole FP8
layer instead. Asking for one raises, naming the primitive. An absent bias or
accumulator is a size-0 placeholder.
"""

from groupgemm.jax_ext import fp8_ffi_calls
from groupgemm.jax_ext.primitives import define


def _not_differentiable(name):
    def refuse(*_, **__):
        raise NotImplementedError(f"{name} is not differentiable: its float8 operands are quantized values. "
                                  "grouped_mlp(fp8=...) has a first derivative in reverse mode (its gradient runs "
                                  "the FP8 GEMMs of the gradients), and no derivative of that gradient")

    return refuse


def _define(name, ffi_call, optional=None, multiple_results=False):
    return define(name, ffi_call, optional, _not_differentiable(name), multiple_results=multiple_results)


quantize_rows_p = _define("groupgemm_fp8_quantize_rows", fp8_ffi_calls.fp8_quantize_rows, multiple_results=True)
quantize_blocks_p = _define("groupgemm_fp8_quantize_blocks", fp8_ffi_calls.fp8_quantize_blocks,
                            multiple_results=True)
quantize_grouped_p = _define("groupgemm_fp8_quantize_grouped", fp8_ffi_calls.fp8_quantize_grouped,
                             multiple_results=True)


scaled_matmul_p = _define("groupgemm_scaled_matmul", fp8_ffi_calls.scaled_matmul, "has_bias")
scaled_wgrad_p = _define("groupgemm_scaled_wgrad", fp8_ffi_calls.scaled_wgrad, "accumulate")
