// The CUDA backend's small kernels around the grouped GEMM: the setup kernel that turns
// device-resident group sizes into the workspace, and the kernels that write what no GEMM
// writes (padding rows, K = 0 rows, empty groups' zeros, late bias, bias gradients).
// Each launcher enqueues on `stream` and returns without waiting.
#pragma once

#include <cuda_runtime.h>

#include "setup.h"

namespace groupgemm {
namespace cuda {

constexpr int kThreads = 256;  // block size of the small kernels
constexpr int64_t kMaxGridX = (int64_t(1) << 31) - 1, kMaxGridYZ = 65535;

// A grid dimension for `count` items, at least 1 and at most `limit` (kernels stride
// over the rest).
inline unsigned grid_dim(int64_t count, int64_t limit) {
  return static_cast<unsigned>(count < 1 ? 1 : (count < limit ? count : limit));
}

// One thread block: the window's row boundaries by a saturating block scan of the sizes,
// then each group's problem, pointers and leading dimensions (src/setup.h).
Status launch_setup(const SetupArgs& args, cudaStream_t stream);

// Forward output rows that no GEMM writes (setup.h's forward_row_fill): padding rows
// become 0; when K = 0 the owned rows become their group's bias (or 0).
Status launch_fill_rows(DType in, DType out_dtype, void* out, const void* bias, int64_t m, int64_t n,
                        bool k_is_zero, int64_t num_groups, const void* workspace, cudaStream_t stream);

// out[r] += bias[group of r] for owned rows of a float32 output (the GEMM epilogue can
// only add a C of the output's dtype).
Status launch_add_bias_rows(DType in, float* out, const void* bias, int64_t m, int64_t n, int64_t num_groups,
                            const void* workspace, cudaStream_t stream);

// wgrad: out[g] = 0 for every group whose action is write_zero.
Status launch_zero_empty_groups(DType out_dtype, void* out, int64_t block_elements, int64_t num_groups,
                                const void* workspace, cudaStream_t stream);

// dbias: out[g, j] = sum of grad[r, j] over group g's rows, in row order (float32).
Status launch_bias_grad(DType in, DType out_dtype, const void* grad, void* out, int64_t n, int64_t num_groups,
                        const void* workspace, cudaStream_t stream);

// The launch status of the last kernel, as a Status.
Status last_launch(const char* what);

}  // namespace cuda
}  // namespace groupgemm
