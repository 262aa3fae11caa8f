// permute on the device: groupgemm/permute.h's steps, one kernel each, reading the
// expert indices where they live. Count and assign run one chunk of slots per thread
// (permute_chunks); the scan runs as one block per bucket, then one block over the
// bucket totals, each in a fixed order, so the rows never depend on scheduling; the fill
// copies rows as raw bits. No atomics, no host synchronisation.
#include <cub/block/block_scan.cuh>

#include "kernels.h"
#include "moe_kernels.h"
#include "permute_workspace.h"

namespace groupgemm {
namespace cuda {
namespace {

struct PermuteWorkspace {
  int32_t* kept_rows;
  int32_t* bucket_start;
  int32_t* counts;
};

PermuteWorkspace permute_workspace(void* base, const PermuteWorkspaceLayout& l) {
  char* b = static_cast<char*>(base);
  return {reinterpret_cast<int32_t*>(b + l.kept_rows), reinterpret_cast<int32_t*>(b + l.bucket_start),
          reinterpret_cast<int32_t*>(b + l.counts)};
}

__global__ void count_kernel(IndexArray expert_indices, int64_t slots, int64_t experts, int64_t chunks,
                             int32_t* counts) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c < chunks) count_chunk_slots(expert_indices, slots, experts, c, chunks, counts);
}

// Hands each tile the sum of the tiles before it.
struct RunningTotal {
  int32_t total;
  __device__ int32_t operator()(int32_t tile_sum) {
    const int32_t before = total;
    total += tile_sum;
    return before;
  }
};

// A block's exclusive scan of n int32 in place, tile by tile, in order; every thread of
// the first warp returns the total (the callback runs there).
template <int Threads, int Items>
__device__ int32_t block_exclusive_scan(int32_t* values, int64_t n) {
  using Scan = cub::BlockScan<int32_t, Threads>;
  __shared__ typename Scan::TempStorage storage;
  RunningTotal running{0};
  constexpr int64_t kTile = int64_t(Threads) * Items;
  for (int64_t tile = 0; tile < n; tile += kTile) {
    int32_t items[Items];
    const int64_t first = tile + int64_t(threadIdx.x) * Items;
    for (int i = 0; i < Items; ++i) items[i] = first + i < n ? values[first + i] : 0;
    Scan(storage).ExclusiveSum(items, items, running);
    for (int i = 0; i < Items; ++i)
      if (first + i < n) values[first + i] = items[i];
    __syncthreads();  // the temp storage is reused by the next tile
  }
  return running.total;
}

constexpr int kBucketScanThreads = 256, kStartScanThreads = 1024, kScanItems = 4;

// Step 2a: one block per bucket (striding over them) scans the bucket's chunk entries.
__global__ void __launch_bounds__(kBucketScanThreads)
    bucket_scan_kernel(int32_t* counts, int64_t buckets, int64_t chunks, int32_t* bucket_start) {
  for (int64_t b = blockIdx.x; b < buckets; b += gridDim.x) {
    const int32_t total =
        block_exclusive_scan<kBucketScanThreads, kScanItems>(bucket_counts(counts, b, chunks), chunks);
    if (threadIdx.x == 0) bucket_start[b] = total;
  }
}

// Step 2b: one block scans the bucket totals into first rows, then reads off the group
// sizes and the kept-row count (the block's global writes are visible after the barrier
// that ends each tile).
__global__ void __launch_bounds__(kStartScanThreads)
    start_scan_kernel(int32_t* bucket_start, int64_t experts, int32_t* group_sizes, int32_t* kept_rows) {
  block_exclusive_scan<kStartScanThreads, kScanItems>(bucket_start, experts + 1);
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x)
    group_sizes[e] = group_size_from_starts(bucket_start, e);
  if (threadIdx.x == 0) *kept_rows = kept_rows_from_starts(bucket_start, experts);
}

__global__ void assign_kernel(IndexArray expert_indices, int64_t slots, int64_t experts, int64_t chunks,
                              const int32_t* bucket_start, int32_t* cursors, int32_t* row_map) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c < chunks)
    assign_chunk_rows(expert_indices, slots, experts, c, chunks, bucket_start, cursors, row_map);
}

// Word: an unsigned integer of the element's size, so a copy keeps every bit.
template <typename Word>
__global__ void fill_kernel(const Word* tokens, Word* permuted, const int32_t* row_map,
                            const int32_t* kept_rows, int64_t slots, int64_t top_k, int64_t hidden) {
  const int64_t kept = *kept_rows;
  for (int64_t i = blockIdx.x; i < slots; i += gridDim.x) {
    const PermuteFill fill = permute_fill(row_map, i, top_k, kept);
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      if (fill.copy_row >= 0) permuted[fill.copy_row * hidden + j] = tokens[fill.token * hidden + j];
      if (fill.zero_row) permuted[i * hidden + j] = Word(0);
    }
  }
}

template <typename Word>
Status launch_fill(const PermuteArgs& a, const int32_t* kept_rows, cudaStream_t stream) {
  const int64_t slots = a.num_tokens * a.top_k;
  fill_kernel<Word><<<grid_dim(slots, 65536), kThreads, 0, stream>>>(
      static_cast<const Word*>(a.tokens), static_cast<Word*>(a.permuted), a.row_map, kept_rows, slots,
      a.top_k, a.hidden);
  return last_launch("the permute fill kernel");
}

}  // namespace

Status launch_permute(const PermuteArgs& a, void* workspace, cudaStream_t stream) {
  const int64_t slots = a.num_tokens * a.top_k;
  const PermuteWorkspaceLayout layout = permute_workspace_layout(slots, a.num_experts);
  const PermuteWorkspace ws = permute_workspace(workspace, layout);
  const int64_t chunks = layout.chunks;
  const unsigned chunk_blocks = grid_dim(ceil_div(chunks, kThreads), kMaxGridX);

  count_kernel<<<chunk_blocks, kThreads, 0, stream>>>(a.expert_indices, slots, a.num_experts, chunks,
                                                      ws.counts);
  GG_RETURN_IF_ERROR(last_launch("the permute count kernel"));
  const int64_t buckets = a.num_experts + 1;
  bucket_scan_kernel<<<grid_dim(buckets, kMaxGridX), kBucketScanThreads, 0, stream>>>(
      ws.counts, buckets, chunks, ws.bucket_start);
  GG_RETURN_IF_ERROR(last_launch("the permute bucket scan kernel"));
  start_scan_kernel<<<1, kStartScanThreads, 0, stream>>>(ws.bucket_start, a.num_experts, a.group_sizes,
                                                         ws.kept_rows);
  GG_RETURN_IF_ERROR(last_launch("the permute start scan kernel"));
  if (slots == 0) return Status::Ok();  // group_sizes (all 0) was the only output
  assign_kernel<<<chunk_blocks, kThreads, 0, stream>>>(a.expert_indices, slots, a.num_experts, chunks,
                                                       ws.bucket_start, ws.counts, a.row_map);
  GG_RETURN_IF_ERROR(last_launch("the permute assign kernel"));
  if (a.hidden == 0) return Status::Ok();
  switch (dtype_size(a.dtype)) {
    case 2: return launch_fill<uint16_t>(a, ws.kept_rows, stream);
    case 4: return launch_fill<uint32_t>(a, ws.kept_rows, stream);
    default: return launch_fill<uint64_t>(a, ws.kept_rows, stream);
  }
}

}  // namespace cuda
}  // namespace groupgemm
