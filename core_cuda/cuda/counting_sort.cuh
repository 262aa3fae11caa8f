// groupgemm/permute.h's stable counting sort on the device, for permute (slots by expert)
// and unpermute's backward (slots by row, one radix pass at a time). Count and place run
// one chunk of items per thread; the scan runs as one block per bucket, then one block
// over the bucket totals, each in a fixed order, so positions never depend on scheduling.
// No atomics, no host synchronisation. The kernels have internal linkage: each
// translation unit that includes this gets its own.
#pragma once

#include <cub/block/block_scan.cuh>

#include "groupgemm/permute.h"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

template <typename Bucket>
__global__ void count_kernel(Bucket bucket, int64_t items, int64_t buckets, int64_t chunks, int32_t* counts) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c < chunks) count_chunk(bucket, items, buckets, c, chunks, counts);
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

// Step 2b: one block scans the bucket totals into first positions. For permute (the last
// bucket holding the dropped slots) it then reads off the group sizes and the kept-row
// count, when given (the block's global writes are visible after the barrier that ends
// each tile).
__global__ void __launch_bounds__(kStartScanThreads)
    start_scan_kernel(int32_t* bucket_start, int64_t buckets, int32_t* group_sizes, int32_t* kept_rows) {
  block_exclusive_scan<kStartScanThreads, kScanItems>(bucket_start, buckets);
  const int64_t experts = buckets - 1;
  if (group_sizes)
    for (int64_t e = threadIdx.x; e < experts; e += blockDim.x)
      group_sizes[e] = group_size_from_starts(bucket_start, e);
  if (kept_rows && threadIdx.x == 0) *kept_rows = kept_rows_from_starts(bucket_start, experts);
}

template <typename Bucket, typename Place>
__global__ void place_kernel(Bucket bucket, int64_t items, int64_t chunks, const int32_t* bucket_start,
                             int32_t* cursors, Place place) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c < chunks) place_chunk(bucket, items, c, chunks, bucket_start, cursors, place);
}

// Steps 1-3 on `stream`: `counts` holds buckets * chunks entries, `bucket_start` buckets.
// group_sizes and kept_rows (permute's, or null) are written after the scan.
template <typename Bucket, typename Place>
Status launch_counting_sort(const Bucket& bucket, int64_t items, int64_t buckets, int64_t chunks,
                            int32_t* counts, int32_t* bucket_start, const Place& place, int32_t* group_sizes,
                            int32_t* kept_rows, cudaStream_t stream) {
  const unsigned chunk_blocks = grid_dim(ceil_div(chunks, kThreads), kMaxGridX);
  count_kernel<<<chunk_blocks, kThreads, 0, stream>>>(bucket, items, buckets, chunks, counts);
  GG_RETURN_IF_ERROR(last_launch("the counting sort's count kernel"));
  bucket_scan_kernel<<<grid_dim(buckets, kMaxGridX), kBucketScanThreads, 0, stream>>>(counts, buckets, chunks,
                                                                                      bucket_start);
  GG_RETURN_IF_ERROR(last_launch("the counting sort's bucket scan kernel"));
  start_scan_kernel<<<1, kStartScanThreads, 0, stream>>>(bucket_start, buckets, group_sizes, kept_rows);
  GG_RETURN_IF_ERROR(last_launch("the counting sort's start scan kernel"));
  if (items == 0) return Status::Ok();
  place_kernel<<<chunk_blocks, kThreads, 0, stream>>>(bucket, items, chunks, bucket_start, counts, place);
  return last_launch("the counting sort's place kernel");
}

}  // namespace
}  // namespace cuda
}  // namespace groupgemm
