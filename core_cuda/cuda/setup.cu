// The setup kernel: reads group_sizes and group_offset where they live (device memory)
// and writes the workspace the GEMM and fill kernels read. Its steps are the shared
// __host__ __device__ functions of src/setup.h; this file only adds the block scan.
#include <cub/block/block_scan.cuh>

#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

constexpr int kSetupThreads = kThreads;

struct SaturatingRowSum {
  int64_t m;
  __device__ int64_t operator()(int64_t a, int64_t b) const { return next_row_boundary(a, b, m); }
};

__global__ void __launch_bounds__(kSetupThreads) setup_kernel(SetupArgs a) {
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const WorkspaceView ws = workspace_view(a.workspace, a.num_groups);
  const int64_t offset = read_group_offset(a.group_offset);
  const GroupWindow w = group_window(offset, a.num_groups, a.group_sizes.count);

  const RowRange chunk = setup_chunk(threadIdx.x, kSetupThreads, w);
  int64_t row = 0;
  Scan(scan_storage).ExclusiveScan(chunk_rows(a, chunk), row, int64_t(0), SaturatingRowSum{a.m});
  write_chunk_boundaries(a, ws, w, chunk, row);
  if (threadIdx.x == 0) write_window(ws, w, offset);
  __syncthreads();  // boundaries and window (global memory) are visible to the whole block
  if (a.kind == SetupKind::rows_only) return;
  for (int64_t local = threadIdx.x; local < a.num_groups; local += kSetupThreads)
    write_group_setup(a, ws, local);
}

}  // namespace

Status last_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string(what) + " failed to launch: " + cudaGetErrorString(e));
}

Status launch_setup(const SetupArgs& args, cudaStream_t stream) {
  setup_kernel<<<1, kSetupThreads, 0, stream>>>(args);
  return last_launch("the grouped GEMM setup kernel");
}

}  // namespace cuda
}  // namespace groupgemm
