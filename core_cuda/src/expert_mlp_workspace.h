// The CUDA backend's workspace of the fused expert MLP (groupgemm/expert_mlp.h): the
// routing's arrays, which its sort kernels write from the device-resident expert ids and
// its GEMMs then read. The caller provides the memory, so nothing is allocated at run time
// and a CUDA graph can replay the call.
#pragma once

#include <cstdint>

#include "groupgemm/expert_mlp.h"
#include "workspace.h"

namespace groupgemm {

// Byte offsets, each 16-byte aligned.
struct ExpertRoutingLayout {
  int64_t chunks;        // C: the slot chunks of the counting sort
  int64_t kept_rows;     // int32: rows of kept slots
  int64_t bucket_start;  // int32[E + 1]: each local expert's first row, then the dropped bucket's
  int64_t counts;        // int32[(E + 1) C]
  int64_t row_map;       // int32[T * k]: each slot's row, -1 when dropped
  int64_t slot_of_row;   // int32[T * k]: each kept row's slot
  int64_t bytes;         // total size
};

GG_HD ExpertRoutingLayout expert_routing_layout(int64_t num_slots, int64_t num_experts) {
  ExpertRoutingLayout l{};
  l.chunks = permute_chunks(num_slots, num_experts);
  l.kept_rows = 0;
  l.bucket_start = align16(4);
  l.counts = l.bucket_start + align16((num_experts + 1) * 4);
  l.row_map = l.counts + align16(count_entries(num_experts, l.chunks) * 4);
  l.slot_of_row = l.row_map + align16(num_slots * 4);
  l.bytes = l.slot_of_row + align16(num_slots * 4);
  return l;
}

}  // namespace groupgemm
