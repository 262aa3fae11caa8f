// The setup kernel: reads group_sizes and group_offset where they live (device memory),
// writes the workspace the GEMM kernels read, and writes the output rows and blocks no
// GEMM writes, in one launch. Every block scans the group sizes into its own shared copy
// of the window's row boundaries (a few hundred sizes: cheaper than a second launch), so
// all blocks can fill while block 0 writes the workspace. Its steps are the shared
// __host__ __device__ functions of src/setup.h; this file adds the block scan, the byte
// and element stores, and the grid.
#include <cub/block/block_scan.cuh>

#include "dtypes.cuh"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

constexpr int kSetupThreads = kThreads;
// Boundaries a block keeps in shared memory (32 KB, under the 48 KB a block has without
// opting in, with the scan's own storage). A call with more local groups runs the setup
// and the fills as two launches, the fills reading the boundaries from the workspace.
constexpr int64_t kMaxSharedBoundaries = 4096;
// Enough blocks to fill the GPU with zeros; each strides over the fill units.
constexpr int64_t kMaxFillBlocks = 1024;

enum class SetupMode : int { fused = 0, setup_only = 1, fill_only = 2 };

struct SaturatingRowSum {
  int64_t m;
  __device__ int64_t operator()(int64_t a, int64_t b) const { return next_row_boundary(a, b, m); }
};

__device__ float load_float(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::bf16: return float(static_cast<const cutlass::bfloat16_t*>(p)[i]);
    case DType::f16: return float(static_cast<const cutlass::half_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

__device__ void store_float(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::bf16: static_cast<cutlass::bfloat16_t*>(p)[i] = cutlass::bfloat16_t(v); break;
    case DType::f16: static_cast<cutlass::half_t*>(p)[i] = cutlass::half_t(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// Bytes [begin, end) of `base` become 0 (the zero of every float dtype), by the whole
// block: 16-byte stores between an unaligned head and tail.
__device__ void zero_bytes(char* base, int64_t begin, int64_t end) {
  char* p = base + begin;
  const int64_t bytes = end - begin;
  const int64_t misalignment = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 16);
  const int64_t head = misalignment == 0 ? 0 : (16 - misalignment < bytes ? 16 - misalignment : bytes);
  const int64_t vectors = (bytes - head) / 16;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) p[i] = 0;
  uint4* body = reinterpret_cast<uint4*>(p + head);
  for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) body[i] = make_uint4(0, 0, 0, 0);
  for (int64_t i = head + vectors * 16 + threadIdx.x; i < bytes; i += blockDim.x) p[i] = 0;
}

__device__ void fill_row(const RowFill& f, const WindowRows& rows, int64_t r) {
  const RowFillAction action = row_fill_action(f, rows, r);
  if (!action.write) return;
  const int64_t row_bytes = f.n * f.out_bytes;
  if (action.bias_local < 0) {
    zero_bytes(static_cast<char*>(f.out), r * row_bytes, (r + 1) * row_bytes);
    return;
  }
  for (int64_t j = threadIdx.x; j < f.n; j += blockDim.x)
    store_float(f.out, f.out_dtype, r * f.n + j, load_float(f.bias, f.bias_dtype, action.bias_local * f.n + j));
}

__global__ void __launch_bounds__(kSetupThreads) setup_kernel(SetupArgs a, SetupMode mode) {
  using Scan = cub::BlockScan<int64_t, kSetupThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  extern __shared__ int64_t shared_boundary[];
  const WorkspaceView ws = workspace_view(a.workspace, a.num_groups);
  const int64_t offset = read_group_offset(a.group_offset);
  const GroupWindow w = group_window(offset, a.num_groups, a.group_sizes.count);
  int64_t* boundary = mode == SetupMode::fused ? shared_boundary : ws.boundary;
  const WindowRows rows{boundary, w, offset};

  if (mode != SetupMode::fill_only) {
    const RowRange chunk = setup_chunk(threadIdx.x, kSetupThreads, w.last);
    int64_t row = 0;
    Scan(scan_storage).ExclusiveScan(chunk_rows(a, chunk), row, int64_t(0), SaturatingRowSum{a.m});
    write_chunk_boundaries(a, boundary, w, chunk, row);
    if (threadIdx.x == 0) write_empty_window_boundary(boundary, w);
    __syncthreads();  // the boundaries are visible to the whole block
    if (blockIdx.x == 0) {
      if (threadIdx.x == 0) write_header(ws, rows);
      if (mode == SetupMode::fused)
        for (int64_t i = threadIdx.x; i <= w.last - w.first; i += blockDim.x) ws.boundary[i] = boundary[i];
      for (int64_t local = threadIdx.x; local < a.num_groups; local += blockDim.x)
        write_group_setup(a, ws, rows, local);
    }
    if (mode == SetupMode::setup_only) return;
  }

  const int64_t units = fill_units(a);
  const int64_t row_units = a.rows.out ? a.m : 0;
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) {
    if (unit < row_units) {
      fill_row(a.rows, rows, unit);
      continue;
    }
    const GroupFillUnit u = group_fill_unit(a, unit);
    if (group_fill_zeroes(a, rows, u.local))
      zero_bytes(static_cast<char*>(a.groups.out) + u.local * a.groups.block_bytes, u.begin, u.end);
  }
}

}  // namespace

Status last_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string(what) + " failed to launch: " + cudaGetErrorString(e));
}

Status launch_setup(const SetupArgs& args, cudaStream_t stream) {
  const unsigned blocks = grid_dim(fill_units(args), kMaxFillBlocks);
  const int64_t boundaries = args.num_groups + 1;  // at most the window's
  if (boundaries <= kMaxSharedBoundaries) {
    setup_kernel<<<blocks, kSetupThreads, boundaries * sizeof(int64_t), stream>>>(args, SetupMode::fused);
    return last_launch("the grouped GEMM setup kernel");
  }
  setup_kernel<<<1, kSetupThreads, 0, stream>>>(args, SetupMode::setup_only);
  GG_RETURN_IF_ERROR(last_launch("the grouped GEMM setup kernel"));
  if (fill_units(args) == 0) return Status::Ok();
  setup_kernel<<<blocks, kSetupThreads, 0, stream>>>(args, SetupMode::fill_only);
  return last_launch("the grouped GEMM fill kernel");
}

}  // namespace cuda
}  // namespace groupgemm
