// The FP8 path's small CUDA kernels: its setup kernel and the copies around the grouped
// GEMM (fp8_setup.cu), and the quantization kernels (fp8_quantize.cu). Each launcher
// enqueues on `stream` and returns without waiting; their per-element decisions are
// fp8_workspace.h's and fp8_math.h's __host__ __device__ functions, which the CPU tests run.
#pragma once

#include <cuda_runtime.h>

#include "fp8_workspace.h"
#include "groupgemm/fp8.h"

namespace groupgemm {
namespace cuda {

// One thread block: row boundaries, first blocks and (matmul, wgrad) each group's GEMM.
Status launch_fp8_setup(const Fp8SetupArgs& s, cudaStream_t stream);

// Matmul: the API's scales into the workspace as the kernel reads them.
Status launch_fp8_relayout_scales(const Fp8SetupArgs& s, cudaStream_t stream);

// Matmul: padding rows zeros; owned rows their group's bias (the epilogue adds to it), or
// zeros when K = 0.
Status launch_fp8_fill_rows(const Fp8SetupArgs& s, DType out_dtype, const void* bias, cudaStream_t stream);

// Wgrad: out[g] = 0 for the local groups without tokens.
Status launch_fp8_zero_empty_groups(const Fp8SetupArgs& s, DType out_dtype, cudaStream_t stream);

// Wgrad: lhs [K, M] and rhs [N, M] copied with each group's tokens from a multiple of 128
// (zeros after), and rowwise scales repeated per token block.
Status launch_fp8_align_tokens(const Fp8SetupArgs& s, cudaStream_t stream);

// The quantizations (groupgemm/fp8.h); the grouped one after launch_fp8_setup(rows_only).
Status launch_fp8_quantize_rows(const QuantizeRowsArgs& a, cudaStream_t stream);
Status launch_fp8_quantize_blocks(const QuantizeBlocksArgs& a, cudaStream_t stream);
Status launch_fp8_quantize_grouped(const QuantizeGroupedArgs& a, const Fp8SetupArgs& s, cudaStream_t stream);

}  // namespace cuda
}  // namespace groupgemm
