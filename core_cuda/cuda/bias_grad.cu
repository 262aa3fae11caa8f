// dbias on CUDA: each block sums kColumns columns of one group's rows, its threads split
// into setup.h's kBiasGradLanes row lanes (lane l sums rows l, l + lanes, ... in order) and
// the lanes' partial sums added in lane order, all in float32: deterministic, no atomics,
// and the host launcher of the core tests sums in the same order.
#include "dtypes.cuh"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

constexpr int kColumns = 32;  // one warp of consecutive columns per lane: coalesced rows

template <typename In, typename Out>
__global__ void __launch_bounds__(kColumns* kBiasGradLanes)
    bias_grad_kernel(const In* grad, Out* out, int64_t n, const void* workspace, int64_t num_groups) {
  __shared__ float partial[kBiasGradLanes][kColumns];
  const WindowRows rows = workspace_rows(workspace_view(const_cast<void*>(workspace), num_groups));
  const int64_t j = blockIdx.x * int64_t(kColumns) + threadIdx.x;
  const int lane = threadIdx.y;
  for (int64_t local = blockIdx.y; local < num_groups; local += gridDim.y) {
    const RowRange group = rows.group(local);
    float sum = 0.0f;  // an empty group sums to exactly 0
    if (j < n)
      for (int64_t r = group.begin + lane; r < group.end; r += kBiasGradLanes) sum += float(grad[r * n + j]);
    partial[lane][threadIdx.x] = sum;
    __syncthreads();
    if (lane == 0 && j < n) {
      float total = partial[0][threadIdx.x];
      for (int l = 1; l < kBiasGradLanes; ++l) total += partial[l][threadIdx.x];
      out[local * n + j] = Out(total);
    }
    __syncthreads();  // partial is rewritten for the next group
  }
}

}  // namespace

Status launch_bias_grad(DType in, DType out_dtype, const void* grad, void* out, int64_t n, int64_t num_groups,
                        const void* workspace, cudaStream_t stream) {
  return visit_cuda_dtypes(in, out_dtype, [&](auto in_tag, auto out_tag) {
    using In = decltype(in_tag);
    using Out = decltype(out_tag);
    const dim3 grid(grid_dim(ceil_div(n, kColumns), kMaxGridX), grid_dim(num_groups, kMaxGridYZ));
    bias_grad_kernel<In, Out><<<grid, dim3(kColumns, kBiasGradLanes), 0, stream>>>(
        static_cast<const In*>(grad), static_cast<Out*>(out), n, workspace, num_groups);
    return last_launch("the bias-gradient kernel");
  });
}

}  // namespace cuda
}  // namespace groupgemm
