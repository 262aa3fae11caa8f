// The FP8 path's setup steps after the 16-bit GEMMs' setup kernel, and the copies around
// its grouped GEMM. Their steps are fp8_workspace.h's __host__ __device__ functions; this
// file adds the block scan and the grids.
#include <algorithm>
#include <cub/block/block_scan.cuh>

#include "dtypes.cuh"
#include "fp8_kernels.h"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

// One block: the first token blocks by a block scan over chunks of the local groups, then
// (weight gradient) each group's GEMM and scale pointers.
__global__ void __launch_bounds__(kThreads) fp8_token_blocks_kernel(Fp8SetupArgs a) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const Fp8WorkspaceView ws = fp8_view(a);
  const WindowRows rows = workspace_rows(ws.base);
  const RowRange chunk = setup_chunk(threadIdx.x, kThreads, a.num_groups);
  int64_t first = 0, total = 0;
  Scan(scan_storage).ExclusiveSum(chunk_token_blocks(rows, chunk), first, total);
  write_first_blocks(ws.first_block, rows, chunk, first);
  if (threadIdx.x == 0) ws.first_block[a.num_groups] = total;
  if (a.kind != Fp8SetupKind::wgrad) return;
  __syncthreads();  // every first block is visible to the whole block
  for (int64_t local = threadIdx.x; local < a.num_groups; local += kThreads) write_wgrad_group(a, ws, local);
}

// Grid-stride over `count` elements.
#define GG_FOR_EACH(i, count)                                                   \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (count); \
       i += int64_t(gridDim.x) * blockDim.x)

unsigned elements_grid(int64_t count) { return grid_dim(ceil_div(count, kThreads), 65535); }

__global__ void fp8_relayout_scales_kernel(Fp8SetupArgs a) {
  const Fp8WorkspaceView ws = fp8_view(a);
  const WindowRows rows = workspace_rows(ws.base);
  const int64_t kb_count = fp8_blocks(a.k);
  GG_FOR_EACH(local, a.num_groups) write_scale_pointers(a, ws, local);
  GG_FOR_EACH(i, a.m * kb_count) {  // lhs: row-major (row, kb) -> its group's [Kb][M_g]
    const int64_t row = i / kb_count, kb = i % kb_count;
    const int64_t slot = lhs_scale_slot(rows, row, kb, kb_count);
    if (slot >= 0) ws.scale_a[slot] = a.operands.a_scale[lhs_scale_index(a.scaling, row, kb, kb_count)];
  }
  GG_FOR_EACH(i, a.num_groups * kb_count * a.n) {  // rhs: [G][Kb][N], one scale per output channel
    const int64_t col = i % a.n, kb = i / a.n % kb_count, g = i / (a.n * kb_count);
    ws.scale_b[i] = a.operands.b_scale[rhs_scale_index(a.scaling, g, col, a.n, kb, kb_count)];
  }
}

__global__ void fp8_align_tokens_kernel(Fp8SetupArgs a) {
  const Fp8WorkspaceView ws = fp8_view(a);
  const WindowRows rows = workspace_rows(ws.base);
  const int64_t tokens = a.layout.aligned_tokens, blocks = ws.first_block[a.num_groups];
  const int64_t used = blocks * kFp8Block;
  const auto* lhs = static_cast<const uint8_t*>(a.operands.a);
  const auto* rhs = static_cast<const uint8_t*>(a.operands.b);
  GG_FOR_EACH(i, (a.k + a.n) * used) {  // lhs rows, then rhs rows; the used aligned columns
    const int64_t channel = i / used, col = i % used;
    const int64_t src = aligned_source_token(rows, ws.first_block, a.num_groups, col);
    if (channel < a.k)
      ws.operand_a[channel * tokens + col] = src >= 0 ? lhs[channel * a.m + src] : uint8_t(0);
    else
      ws.operand_b[(channel - a.k) * tokens + col] = src >= 0 ? rhs[(channel - a.k) * a.m + src] : uint8_t(0);
  }
  if (a.scaling != Fp8Scaling::rowwise) return;
  GG_FOR_EACH(i, blocks * (a.k + a.n)) {  // rowwise: each block's row is its group's
    const int64_t b = i / (a.k + a.n), c = i % (a.k + a.n);
    const int64_t g = group_of_block(ws.first_block, a.num_groups, b);
    if (c < a.k)
      ws.scale_a[b * a.k + c] = a.operands.a_scale[g * a.k + c];
    else
      ws.scale_b[b * a.n + c - a.k] = a.operands.b_scale[g * a.n + c - a.k];
  }
}

}  // namespace

Status launch_fp8_token_blocks(const Fp8SetupArgs& s, cudaStream_t stream) {
  fp8_token_blocks_kernel<<<1, kThreads, 0, stream>>>(s);
  return last_launch("the FP8 token block kernel");
}

Status launch_fp8_relayout_scales(const Fp8SetupArgs& s, cudaStream_t stream) {
  const int64_t count = std::max({s.num_groups, s.m * fp8_blocks(s.k), s.num_groups * fp8_blocks(s.k) * s.n});
  fp8_relayout_scales_kernel<<<elements_grid(count), kThreads, 0, stream>>>(s);
  return last_launch("the FP8 scale layout kernel");
}

Status launch_fp8_align_tokens(const Fp8SetupArgs& s, cudaStream_t stream) {
  // Sized for the most columns any routing uses: the kernel reads the used count itself.
  fp8_align_tokens_kernel<<<elements_grid((s.k + s.n) * s.layout.aligned_tokens), kThreads, 0, stream>>>(s);
  return last_launch("the FP8 token alignment kernel");
}

}  // namespace cuda
}  // namespace groupgemm
