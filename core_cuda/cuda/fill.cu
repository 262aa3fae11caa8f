// Kernels that write what no GEMM writes, reading the schedule the setup kernel left in
// the workspace (the window, row boundaries and each group's action), so they need no
// host-side knowledge of the group sizes either. Their per-row and per-group decisions
// are setup.h's functions, which the CPU tests run too.
#include "dtypes.cuh"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

// Enough blocks to fill the GPU; each block strides over rows, its threads over columns.
unsigned row_blocks(int64_t rows) { return grid_dim(rows, 4096); }

template <typename In, typename Out>
__global__ void fill_rows_kernel(Out* out, const In* bias, int64_t m, int64_t n, bool k_is_zero,
                                 const void* workspace, int64_t num_groups) {
  const WorkspaceView ws = workspace_view(const_cast<void*>(workspace), num_groups);
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const RowFill fill = forward_row_fill(ws, r, k_is_zero, bias != nullptr);
    if (!fill.write) continue;
    const In* bias_row = fill.local >= 0 ? bias + fill.local * n : nullptr;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      out[r * n + j] = bias_row ? Out(float(bias_row[j])) : Out(0.0f);
  }
}

template <typename In>
__global__ void add_bias_rows_kernel(float* out, const In* bias, int64_t m, int64_t n, const void* workspace,
                                     int64_t num_groups) {
  const WorkspaceView ws = workspace_view(const_cast<void*>(workspace), num_groups);
  for (int64_t r = blockIdx.x; r < m; r += gridDim.x) {
    const int64_t local = local_group_of_row(ws, r);
    if (local < 0) continue;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) out[r * n + j] += float(bias[local * n + j]);
  }
}

template <typename Out>
__global__ void zero_empty_groups_kernel(Out* out, int64_t block_elements, const void* workspace,
                                         int64_t num_groups) {
  const WorkspaceView ws = workspace_view(const_cast<void*>(workspace), num_groups);
  for (int64_t g = blockIdx.y; g < num_groups; g += gridDim.y) {
    if (ws.action[g] != static_cast<int32_t>(GroupAction::write_zero)) continue;
    Out* block = out + g * block_elements;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < block_elements;
         i += int64_t(gridDim.x) * blockDim.x)
      block[i] = Out(0.0f);
  }
}

}  // namespace

Status launch_fill_rows(DType in, DType out_dtype, void* out, const void* bias, int64_t m, int64_t n,
                        bool k_is_zero, int64_t num_groups, const void* workspace, cudaStream_t stream) {
  return visit_cuda_dtypes(in, out_dtype, [&](auto in_tag, auto out_tag) {
    using In = decltype(in_tag);
    using Out = decltype(out_tag);
    fill_rows_kernel<In, Out><<<row_blocks(m), kThreads, 0, stream>>>(
        static_cast<Out*>(out), static_cast<const In*>(bias), m, n, k_is_zero, workspace, num_groups);
    return last_launch("the padding-row kernel");
  });
}

Status launch_add_bias_rows(DType in, float* out, const void* bias, int64_t m, int64_t n, int64_t num_groups,
                            const void* workspace, cudaStream_t stream) {
  return visit_cuda_dtype(in, [&](auto in_tag) {
    using In = decltype(in_tag);
    add_bias_rows_kernel<In><<<row_blocks(m), kThreads, 0, stream>>>(out, static_cast<const In*>(bias), m, n,
                                                                     workspace, num_groups);
    return last_launch("the bias kernel");
  });
}

Status launch_zero_empty_groups(DType out_dtype, void* out, int64_t block_elements, int64_t num_groups,
                                const void* workspace, cudaStream_t stream) {
  return visit_cuda_dtype(out_dtype, [&](auto out_tag) {
    using Out = decltype(out_tag);
    const dim3 grid(grid_dim(ceil_div(block_elements, kThreads), 64), grid_dim(num_groups, kMaxGridYZ));
    zero_empty_groups_kernel<Out>
        <<<grid, kThreads, 0, stream>>>(static_cast<Out*>(out), block_elements, workspace, num_groups);
    return last_launch("the empty-group kernel");
  });
}

}  // namespace cuda
}  // namespace groupgemm
