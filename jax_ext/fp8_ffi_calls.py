"""The FP8 calls of groupgemm for JAX: the XLA FFI targets of groupgemm/fp8.h,
registered at import, and one custom call each, partitioned by its layout
(partitioning.py); fp8_primitives.py makes primitives of them. float8 arrays carry their
format as their dtype; scales are float32; on CUDA the workspace is an extra result (a
command buffer cannot allocate).

What a layout may split: the quantizers' rows (one scale per row or per 1 x 128 tile, or
per 128 x 128 block of a batch entry) and the grouped quantizer's channels; the scaled
GEMMs' ragged rows, experts and, for the rowwise recipe, N (one scale per output
channel). A dimension that a scale block spans whole (K, a blockwise N, the tokens of a
blockwise weight gradient, whose blocks are numbered over the whole window) is gathered.

Arguments arrive checked (fp8.py); the core re-checks what it can see.
"""

import jax
import jax.numpy as jnp
import numpy as np

from groupgemm import _contract as contract
from groupgemm import _core
from groupgemm.jax_ext.ffi_calls import placeholder, workspace
from groupgemm.jax_ext.partitioning import Layout, partitioned

FP8_JAX_DTYPES = tuple(jnp.dtype(name) for name in contract.FP8_DTYPES)  # by the core's Fp8Type
ROWWISE = 0  # the core's Fp8Scaling


def _workspace(call, scaling, num_groups, m, k, n):
    return workspace(_core.fp8_workspace_bytes, call, _core.Fp8Scaling(scaling), num_groups, m, k, n)


# ---- quantization ---------------------------------------------------------------------


def _quantize_rows_layout(*, scaling, row_dims, **_):
    # x [R..., C] -> q [R..., C], scale [R...] or [R..., ceil(C/128)]: each row on its own;
    # a weight's [G, N] rows are two factors (no reshape: either may be sharded).
    rows = " ".join(f"r{i}" for i in range(row_dims))
    if scaling == ROWWISE:
        return Layout((f"{rows} c",), (f"{rows} c", rows), replicated=("c",))
    return Layout((f"{rows} c",), (f"{rows} c", f"{rows} cb"), replicated=("c", "cb"))


def _empty_rows_quantized(shapes):
    """Rows without elements: no values, and the scale of an amax of 0, which is 1."""
    (q_shape, q_dtype), (scale_shape, scale_dtype) = shapes
    return jnp.zeros(q_shape, q_dtype), jnp.ones(scale_shape, scale_dtype)


@partitioned(_quantize_rows_layout, without_data=_empty_rows_quantized)
def fp8_quantize_rows(x, *, out_type, scaling, power_of_two, row_dims):
    *rows, cols = x.shape
    scale_shape = tuple(rows) if scaling == ROWWISE else (*rows, contract.fp8_blocks(cols))
    call = jax.ffi.ffi_call("groupgemm_fp8_quantize_rows",
                            (jax.ShapeDtypeStruct(x.shape, FP8_JAX_DTYPES[out_type]),
                             jax.ShapeDtypeStruct(scale_shape, jnp.float32)))
    return tuple(call(x, scaling=np.int64(scaling), power_of_two=np.bool_(power_of_two)))


# x [B, R, C] -> q [B, R, C], scale [B, ceil(R/128), ceil(C/128)]: each batch entry (expert) on its own.
@partitioned(Layout(("b r c",), ("b r c", "b rb cb"), replicated=("r", "c", "rb", "cb")))
def fp8_quantize_blocks(x, *, out_type, power_of_two):
    b, rows, cols = x.shape
    call = jax.ffi.ffi_call("groupgemm_fp8_quantize_blocks",
                            (jax.ShapeDtypeStruct(x.shape, FP8_JAX_DTYPES[out_type]),
                             jax.ShapeDtypeStruct((b, contract.fp8_blocks(rows), contract.fp8_blocks(cols)),
                                                  jnp.float32)))
    return tuple(call(x, power_of_two=np.bool_(power_of_two)))


# x [M, C], group_sizes, group_offset -> q [C, M], scale [G or B, C]: each channel on its own; a
# scale spans its group's (or block's) tokens, numbered over the whole window.
@partitioned(Layout(("m c", "t", ""), ("c m", "s c"), replicated=("m", "t", "s")))
def fp8_quantize_grouped(x, group_sizes, group_offset, *, num_groups, out_type, scaling, power_of_two):
    m, c = x.shape
    rows = num_groups if scaling == ROWWISE else contract.fp8_token_block_bound(m, num_groups)
    call = jax.ffi.ffi_call("groupgemm_fp8_quantize_grouped",
                            (jax.ShapeDtypeStruct((c, m), FP8_JAX_DTYPES[out_type]),
                             jax.ShapeDtypeStruct((rows, c), jnp.float32),
                             _workspace(_core.Fp8Call.quantize_grouped, scaling, num_groups, m, 0, 0)))
    q, scale, _ = call(x, group_sizes, group_offset, num_groups=np.int64(num_groups), scaling=np.int64(scaling),
                       power_of_two=np.bool_(power_of_two))
    return q, scale


# ---- scaled grouped GEMMs -------------------------------------------------------------


def _scaled_matmul_layout(*, scaling, **_):
    # lhs [M, K], rhs [G, N, K], lhs_scale, rhs_scale, group_sizes, group_offset, bias [G, N] -> [M, N]:
    # the rows and the experts as grouped_matmul's; K is gathered (its scale blocks, the
    # accumulation every 128 of it), and N too unless each output channel has its own scale.
    if scaling == ROWWISE:
        return Layout(("m k", "g n k", "m", "g n", "t", "", "g n"), ("m n",), rows="m", groups="g", summed=("g",),
                      replicated=("k", "t"), added=(6,), sizes=4, offset=5)
    return Layout(("m k", "g n k", "m kb", "g nb kb", "t", "", "g n"), ("m n",), rows="m", groups="g",
                  summed=("g",), replicated=("k", "n", "kb", "nb", "t"), added=(6,), sizes=4, offset=5)


@partitioned(_scaled_matmul_layout)
def scaled_matmul(lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset, bias=None, *, scaling, out_dtype):
    (m, k), (g, n, _) = lhs.shape, rhs.shape
    call = jax.ffi.ffi_call("groupgemm_scaled_matmul",
                            (jax.ShapeDtypeStruct((m, n), out_dtype),
                             _workspace(_core.Fp8Call.matmul, scaling, g, m, k, n)))
    out, _ = call(lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset,
                  placeholder(out_dtype) if bias is None else bias, scaling=np.int64(scaling))
    return (out,)


def _scaled_wgrad_layout(*, scaling, **_):
    # lhs [K, M], rhs [N, M], lhs_scale, rhs_scale, group_sizes, group_offset, accumulate_into
    # [G, K, N] -> [G, K, N]: K and N split as the channels they are. Rowwise, the tokens are
    # contracted as grouped_matmul_wgrad's rows (a group's scale serves any of its tokens)
    # and the experts split with their scale rows; blockwise, the token blocks are numbered
    # over the whole window, so both are gathered.
    if scaling == ROWWISE:
        return Layout(("k m", "n m", "g k", "g n", "t", "", "g k n"), ("g k n",), rows="m", groups="g",
                      summed=("m",), replicated=("t",), added=(6,), sizes=4, offset=5,
                      local_sizes=(("num_groups", "g"),), dtypes=((0, "out_dtype"),))
    return Layout(("k m", "n m", "b k", "b n", "t", "", "g k n"), ("g k n",), replicated=("m", "b", "g", "t"),
                  sizes=4, offset=5)


@partitioned(_scaled_wgrad_layout)
def scaled_wgrad(lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset, accumulate_into=None, *, num_groups,
                 scaling, out_dtype):
    (k, m), n = lhs.shape, rhs.shape[0]
    accumulate = accumulate_into is not None
    call = jax.ffi.ffi_call("groupgemm_scaled_wgrad",
                            (jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
                             _workspace(_core.Fp8Call.wgrad, scaling, num_groups, m, k, n)),
                            # The accumulator is updated in place when the caller donates it.
                            input_output_aliases={6: 0} if accumulate else None)
    out, _ = call(lhs, rhs, lhs_scale, rhs_scale, group_sizes, group_offset,
                  accumulate_into if accumulate else placeholder(out_dtype), scaling=np.int64(scaling),
                  accumulate=np.bool_(accumulate))
    return (out,)
