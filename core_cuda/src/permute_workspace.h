// The CUDA backend's workspaces of the expert layer's sorts (groupgemm/permute.h):
// permute's (the kept-row count, the buckets' first rows and the counts array of the
// chunked counting sort) and unpermute's backward (the radix passes' counts and two slot
// orders). The caller provides the memory, so nothing is allocated at run time and a
// CUDA graph can replay the call.
#pragma once

#include <cstdint>

#include "groupgemm/permute.h"
#include "workspace.h"

namespace groupgemm {

// Byte offsets, each 16-byte aligned.
struct PermuteWorkspaceLayout {
  int64_t chunks;        // C: the slot chunks, one per thread of the count and assign kernels
  int64_t kept_rows;     // int32: rows of kept slots (the dropped rows start there)
  int64_t bucket_start;  // int32[E + 1]: bucket totals, then each bucket's first row
  int64_t counts;        // int32[(E + 1) C]: counts, then offsets within the bucket, then cursors
  int64_t bytes;         // total size
};

GG_HD PermuteWorkspaceLayout permute_workspace_layout(int64_t num_slots, int64_t num_experts) {
  PermuteWorkspaceLayout l{};
  l.chunks = permute_chunks(num_slots, num_experts);
  l.kept_rows = 0;
  l.bucket_start = align16(4);
  l.counts = l.bucket_start + align16((num_experts + 1) * 4);
  l.bytes = l.counts + align16(count_entries(num_experts, l.chunks) * 4);
  return l;
}

// Byte offsets, each 16-byte aligned.
struct RowSortWorkspaceLayout {
  int64_t chunks;        // C: the slot chunks of each radix pass
  int64_t bucket_start;  // int32[256]: each digit's first position
  int64_t counts;        // int32[256 C]
  int64_t order[2];      // int32[T * k] each: the slots before and after a pass
  int64_t bytes;         // total size
};

GG_HD RowSortWorkspaceLayout row_sort_workspace_layout(int64_t num_slots) {
  RowSortWorkspaceLayout l{};
  l.chunks = row_sort_chunks(num_slots);
  l.bucket_start = 0;
  l.counts = align16(kRowDigitBuckets * 4);
  l.order[0] = l.counts + align16(kRowDigitBuckets * l.chunks * 4);
  l.order[1] = l.order[0] + align16(num_slots * 4);
  l.bytes = l.order[1] + align16(num_slots * 4);
  return l;
}

}  // namespace groupgemm
