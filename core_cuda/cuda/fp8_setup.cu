// The FP8 path's setup kernel and the copies around its grouped GEMM. Their steps are
// fp8_workspace.h's __host__ __device__ functions; these files add the block scans and
// the grids.
#include <algorithm>
#include <cub/block/block_scan.cuh>

#include "dtypes.cuh"
#include "fp8_kernels.h"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

struct SaturatingRowSum {
  int64_t m;
  __device__ int64_t operator()(int64_t a, int64_t b) const { return next_row_boundary(a, b, m); }
};

__global__ void __launch_bounds__(kThreads) fp8_setup_kernel(Fp8SetupArgs a) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const Fp8WorkspaceView ws = fp8_workspace_view(a.workspace, a.layout);
  const int64_t offset = read_group_offset(a.group_offset);
  const GroupWindow w = group_window(offset, a.num_groups, a.group_sizes.count);

  const RowRange groups = fp8_setup_chunk(threadIdx.x, kThreads, w.last);
  int64_t row = 0;
  Scan(scan_storage).ExclusiveScan(fp8_chunk_rows(a, groups), row, int64_t(0), SaturatingRowSum{a.m});
  write_fp8_boundaries(a, ws, w, groups, row);
  if (threadIdx.x == 0) write_fp8_window(ws, w, offset);
  __syncthreads();  // boundaries and window are visible to the whole block, scan_storage free again

  const RowRange local = fp8_setup_chunk(threadIdx.x, kThreads, a.num_groups);
  int64_t first = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(fp8_chunk_blocks(ws, local), first, total);
  write_fp8_first_blocks(ws, local, first);
  if (threadIdx.x == 0) ws.first_block[a.num_groups] = total;
  __syncthreads();
  if (a.kind == Fp8SetupKind::rows_only) return;
  for (int64_t g = threadIdx.x; g < a.num_groups; g += kThreads) write_fp8_group_setup(a, ws, g);
}

// Grid-stride over `count` elements.
#define GG_FOR_EACH(i, count)                                                   \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (count); \
       i += int64_t(gridDim.x) * blockDim.x)

unsigned elements_grid(int64_t count) { return grid_dim(ceil_div(count, kThreads), 65535); }

__global__ void fp8_relayout_scales_kernel(Fp8SetupArgs a) {
  const Fp8WorkspaceView ws = fp8_workspace_view(a.workspace, a.layout);
  const int64_t kb_count = fp8_blocks(a.k);
  GG_FOR_EACH(i, a.m * kb_count) {  // lhs: row-major (row, kb) -> its group's [Kb][M_g]
    const int64_t row = i / kb_count, kb = i % kb_count;
    const int64_t slot = fp8_lhs_scale_slot(ws, row, kb, kb_count);
    if (slot >= 0) ws.scale_a[slot] = a.operands.a_scale[lhs_scale_index(a.scaling, row, kb, kb_count)];
  }
  GG_FOR_EACH(i, a.num_groups * kb_count * a.n) {  // rhs: [G][Kb][N], one scale per output channel
    const int64_t col = i % a.n, kb = i / a.n % kb_count, g = i / (a.n * kb_count);
    ws.scale_b[i] = fp8_rhs_scale(a.scaling, a.operands.b_scale, g, kb, col, a.n, kb_count);
  }
}

template <typename Out>
__global__ void fp8_fill_rows_kernel(Fp8SetupArgs a, const Out* bias) {
  const Fp8WorkspaceView ws = fp8_workspace_view(a.workspace, a.layout);
  Out* out = static_cast<Out*>(a.operands.d);
  for (int64_t r = blockIdx.x; r < a.m; r += gridDim.x) {
    const Fp8RowFill fill = fp8_row_fill(ws, r, bias != nullptr, a.k == 0);
    if (!fill.write) continue;
    const Out* bias_row = fill.bias_group >= 0 ? bias + fill.bias_group * a.n : nullptr;
    for (int64_t j = threadIdx.x; j < a.n; j += blockDim.x)
      out[r * a.n + j] = bias_row ? bias_row[j] : Out(0.0f);
  }
}

template <typename Out>
__global__ void fp8_zero_empty_groups_kernel(Fp8SetupArgs a) {
  const Fp8WorkspaceView ws = fp8_workspace_view(a.workspace, a.layout);
  const int64_t block = a.k * a.n;
  for (int64_t g = blockIdx.y; g < a.num_groups; g += gridDim.y) {
    if (fp8_group_rows(ws, g).rows() > 0) continue;
    Out* out = static_cast<Out*>(a.operands.d) + g * block;
    GG_FOR_EACH(i, block) out[i] = Out(0.0f);
  }
}

__global__ void fp8_align_tokens_kernel(Fp8SetupArgs a) {
  const Fp8WorkspaceView ws = fp8_workspace_view(a.workspace, a.layout);
  const int64_t tokens = a.layout.aligned_tokens, used = ws.first_block[a.num_groups] * kFp8Block;
  const auto* lhs = static_cast<const uint8_t*>(a.operands.a);
  const auto* rhs = static_cast<const uint8_t*>(a.operands.b);
  GG_FOR_EACH(i, (a.k + a.n) * used) {  // lhs rows, then rhs rows; the used aligned columns
    const int64_t channel = i / used, col = i % used;
    const int64_t src = fp8_aligned_source_token(ws, a.num_groups, col);
    if (channel < a.k)
      ws.operand_a[channel * tokens + col] = src >= 0 ? lhs[channel * a.m + src] : uint8_t(0);
    else
      ws.operand_b[(channel - a.k) * tokens + col] = src >= 0 ? rhs[(channel - a.k) * a.m + src] : uint8_t(0);
  }
  if (a.scaling != Fp8Scaling::rowwise) return;
  const int64_t blocks = ws.first_block[a.num_groups];
  GG_FOR_EACH(i, blocks * (a.k + a.n)) {  // rowwise: each block's row is its group's
    const int64_t b = i / (a.k + a.n), c = i % (a.k + a.n);
    const int64_t g = fp8_group_of_block(ws, a.num_groups, b);
    if (c < a.k)
      ws.scale_a[b * a.k + c] = a.operands.a_scale[g * a.k + c];
    else
      ws.scale_b[b * a.n + c - a.k] = a.operands.b_scale[g * a.n + c - a.k];
  }
}

}  // namespace

Status launch_fp8_setup(const Fp8SetupArgs& s, cudaStream_t stream) {
  fp8_setup_kernel<<<1, kThreads, 0, stream>>>(s);
  return last_launch("the FP8 setup kernel");
}

Status launch_fp8_relayout_scales(const Fp8SetupArgs& s, cudaStream_t stream) {
  const int64_t count = std::max(s.m * fp8_blocks(s.k), s.num_groups * fp8_blocks(s.k) * s.n);
  fp8_relayout_scales_kernel<<<elements_grid(count), kThreads, 0, stream>>>(s);
  return last_launch("the FP8 scale layout kernel");
}

Status launch_fp8_fill_rows(const Fp8SetupArgs& s, DType out_dtype, const void* bias, cudaStream_t stream) {
  return visit_cuda_dtype(out_dtype, [&](auto out_tag) {
    using Out = decltype(out_tag);
    fp8_fill_rows_kernel<Out><<<grid_dim(s.m, 4096), kThreads, 0, stream>>>(s, static_cast<const Out*>(bias));
    return last_launch("the FP8 row fill kernel");
  });
}

Status launch_fp8_zero_empty_groups(const Fp8SetupArgs& s, DType out_dtype, cudaStream_t stream) {
  return visit_cuda_dtype(out_dtype, [&](auto out_tag) {
    using Out = decltype(out_tag);
    const dim3 grid(grid_dim(ceil_div(s.k * s.n, kThreads), 1024), grid_dim(s.num_groups, kMaxGridYZ));
    fp8_zero_empty_groups_kernel<Out><<<grid, kThreads, 0, stream>>>(s);
    return last_launch("the FP8 empty-group zeroing kernel");
  });
}

Status launch_fp8_align_tokens(const Fp8SetupArgs& s, cudaStream_t stream) {
  // Sized for the most columns any routing uses: the kernel reads the used count itself.
  fp8_align_tokens_kernel<<<elements_grid((s.k + s.n) * s.layout.aligned_tokens), kThreads, 0, stream>>>(s);
  return last_launch("the FP8 token alignment kernel");
}

}  // namespace cuda
}  // namespace groupgemm
