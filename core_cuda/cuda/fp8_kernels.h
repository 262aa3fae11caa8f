// The FP8 path's small CUDA kernels, after the 16-bit GEMMs' setup kernel (kernels.h's
// launch_setup) has written the window and filled the output: its own setup steps and the
// copies around the grouped GEMM (fp8_setup.cu), and the quantization kernels
// (fp8_quantize.cu). Each launcher enqueues on `stream` and returns without waiting; their
// per-element decisions are fp8_workspace.h's and fp8_math.h's __host__ __device__
// functions, which the CPU tests run.
#pragma once

#include <cuda_runtime.h>

#include "fp8_workspace.h"
#include "groupgemm/fp8.h"

namespace groupgemm {
namespace cuda {

// One thread block: each local group's first token block and, for the weight gradient,
// its GEMM and scale pointers.
Status launch_fp8_token_blocks(const Fp8SetupArgs& s, cudaStream_t stream);

// Matmul: each group's scale pointers, and the API's scales into the workspace as the
// kernel reads them.
Status launch_fp8_relayout_scales(const Fp8SetupArgs& s, cudaStream_t stream);

// Wgrad: lhs [K, M] and rhs [N, M] copied with each group's tokens from a multiple of 128
// (zeros after), and rowwise scales repeated per token block.
Status launch_fp8_align_tokens(const Fp8SetupArgs& s, cudaStream_t stream);

// The quantizations (groupgemm/fp8.h); the grouped one after the setup (and, blockwise,
// launch_fp8_token_blocks).
Status launch_fp8_quantize_rows(const QuantizeRowsArgs& a, cudaStream_t stream);
Status launch_fp8_quantize_blocks(const QuantizeBlocksArgs& a, cudaStream_t stream);
Status launch_fp8_quantize_grouped(const QuantizeGroupedArgs& a, const Fp8SetupArgs& s, cudaStream_t stream);

}  // namespace cuda
}  // namespace groupgemm
