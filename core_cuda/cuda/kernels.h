// The CUDA backend's small kernels around the grouped GEMM: the setup kernel that turns
// device-resident group sizes into the workspace and writes what no GEMM writes (padding
// rows, K = 0 rows, bias rows, empty groups' zeros), and the bias gradient.
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

// The setup (src/setup.h): the window's row boundaries by a saturating block scan of the
// sizes, each GEMM set's problems, pointers and leading dimensions, and the row and group
// fills, in one launch (two when the window has more groups than shared memory holds).
Status launch_setup(const SetupArgs& args, cudaStream_t stream);

// dbias: out[g, j] = sum of grad[r, j] over group g's rows, in float32, rows split over
// setup.h's kBiasGradLanes lanes and the lanes added in order.
Status launch_bias_grad(DType in, DType out_dtype, const void* grad, void* out, int64_t n, int64_t num_groups,
                        const void* workspace, cudaStream_t stream);

// The launch status of the last kernel, as a Status.
Status last_launch(const char* what);

}  // namespace cuda
}  // namespace groupgemm
