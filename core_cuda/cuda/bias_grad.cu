// dbias on CUDA: one thread per (group, column) sums that column over the group's rows
// in row order, in float32, exactly as the CPU backend does: deterministic, no atomics.
#include "dtypes.cuh"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

template <typename In, typename Out>
__global__ void bias_grad_kernel(const In* grad, Out* out, int64_t n, const void* workspace,
                                 int64_t num_groups) {
  const WorkspaceView ws = workspace_view(const_cast<void*>(workspace), num_groups);
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= n) return;
  for (int64_t local = blockIdx.y; local < num_groups; local += gridDim.y) {
    const RowRange rows = workspace_group_rows(ws, local);
    float sum = 0.0f;  // an empty group sums to exactly 0
    for (int64_t r = rows.begin; r < rows.end; ++r) sum += float(grad[r * n + j]);
    out[local * n + j] = Out(sum);
  }
}

}  // namespace

Status launch_bias_grad(DType in, DType out_dtype, const void* grad, void* out, int64_t n, int64_t num_groups,
                        const void* workspace, cudaStream_t stream) {
  return visit_cuda_dtypes(in, out_dtype, [&](auto in_tag, auto out_tag) {
    using In = decltype(in_tag);
    using Out = decltype(out_tag);
    const dim3 grid(grid_dim(ceil_div(n, kThreads), kMaxGridX), grid_dim(num_groups, kMaxGridYZ));
    bias_grad_kernel<In, Out><<<grid, kThreads, 0, stream>>>(
        static_cast<const In*>(grad), static_cast<Out*>(out), n, workspace, num_groups);
    return last_launch("the bias-gradient kernel");
  });
}

}  // namespace cuda
}  // namespace groupgemm
