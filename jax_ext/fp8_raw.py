"""The raw FP8 calls of groupgemm for JAX: the XLA FFI targets of groupgemm/fp8.h,
registered at import, and one custom call each (fp8_primitives.py makes primitives of
them). float8 arrays carry their format as their dtype; scales are float32; on CUDA the
workspace is an extra result (a command buffer cannot allocate).

Arguments arrive checked (fp8.py); the core re-checks what it can see.
"""

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _contract as contract
from groupgemm import _core
from groupgemm.jax_ext.raw import mark_varying, varying_axes

FP8_JAX_DTYPES = tuple(jnp.dtype(name) for name in contract.FP8_DTYPES)  # by the core's Fp8Type


def _register_targets():
    platforms = ["cpu"] + (["CUDA"] if _core.cuda_compiled() else [])
    handlers = _core.fp8_ffi_handlers()
    for platform in platforms:
        for name, capsule in handlers[platform].items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)


_register_targets()


def _workspace(call, scaling, num_groups, m, k, n):
    nbytes = (_core.fp8_workspace_bytes(_core.Device.cuda, call, _core.Fp8Scaling(scaling), num_groups, m, k, n)
              if _core.cuda_compiled() else 0)
    return jax.ShapeDtypeStruct((nbytes,), jnp.uint8)


def _varying(values, *operands):
    axes = varying_axes(*operands)
    return tuple(mark_varying(v, axes) for v in values)


def quantize_rows(x, *, out_type, scaling, power_of_two):
    rows, cols = x.shape
    scale_shape = (rows,) if scaling == 0 else (rows, contract.fp8_blocks(cols))
    call = jax.ffi.ffi_call("groupgemm_fp8_quantize_rows",
                            (jax.ShapeDtypeStruct(x.shape, FP8_JAX_DTYPES[out_type]),
                             jax.ShapeDtypeStruct(scale_shape, jnp.float32)),
                            vmap_method="sequential")
    return _varying(call(x, scaling=np.int32(scaling), power_of_two=np.bool_(power_of_two)), x)


def quantize_blocks(x, *, out_type, power_of_two):
    b, rows, cols = x.shape
    call = jax.ffi.ffi_call("groupgemm_fp8_quantize_blocks",
                            (jax.ShapeDtypeStruct(x.shape, FP8_JAX_DTYPES[out_type]),
                             jax.ShapeDtypeStruct((b, contract.fp8_blocks(rows), contract.fp8_blocks(cols)),
                                                  jnp.float32)),
                            vmap_method="sequential")
    return _varying(call(x, power_of_two=np.bool_(power_of_two)), x)


def quantize_grouped(x, group_sizes, group_offset, *, num_groups, out_type, scaling, power_of_two):
    m, c = x.shape
    rows = num_groups if scaling == 0 else contract.fp8_token_block_bound(m, num_groups)
    call = jax.ffi.ffi_call("groupgemm_fp8_quantize_grouped",
                            (jax.ShapeDtypeStruct((c, m), FP8_JAX_DTYPES[out_type]),
                             jax.ShapeDtypeStruct((rows, c), jnp.float32),
                             _workspace(_core.Fp8Call.quantize_grouped, scaling, num_groups, m, 0, 0)),
                            vmap_method="sequential")
    q, scale, _ = call(x, group_sizes, group_offset, num_groups=np.int64(num_groups), scaling=np.int32(scaling),
                       power_of_two=np.bool_(power_of_two))
    return _varying((q, scale), x, group_sizes, group_offset)


def scaled_matmul(lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset, bias, *, scaling, out_dtype):
    (m, k), (g, n, _) = lhs.shape, rhs.shape
    call = jax.ffi.ffi_call("groupgemm_scaled_matmul",
                            (jax.ShapeDtypeStruct((m, n), out_dtype),
                             _workspace(_core.Fp8Call.matmul, scaling, g, m, k, n)),
                            vmap_method="sequential")
    out, _ = call(lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset,
                  jnp.zeros((0,), out_dtype) if bias is None else bias, scaling=np.int32(scaling),
                  has_bias=np.bool_(bias is not None))
    return _varying((out,), lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset, bias)[0]


def scaled_wgrad(lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset, accumulate_into, *, num_groups, scaling,
                 out_dtype):
    (k, m), n = lhs.shape, rhs.shape[0]
    accumulate = accumulate_into is not None
    call = jax.ffi.ffi_call("groupgemm_scaled_wgrad",
                            (jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
                             _workspace(_core.Fp8Call.wgrad, scaling, num_groups, m, k, n)),
                            vmap_method="sequential",
                            # The accumulator is updated in place when the caller donates it.
                            input_output_aliases={6: 0} if accumulate else None)
    out, _ = call(lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset,
                  accumulate_into if accumulate else jnp.zeros((0,), out_dtype), scaling=np.int32(scaling),
                  accumulate=np.bool_(accumulate))
    return _varying((out,), lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset, accumulate_into)[0]
