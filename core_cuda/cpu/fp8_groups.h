// The row range of each local group of an FP8 call on the CPU, from the schedule
// (groupgemm/schedule.h) walked on the host, and the first token block of each group.
#pragma once

#include <cstdint>
#include <vector>

#include "groupgemm/fp8_blocks.h"

namespace groupgemm {
namespace cpu {

struct LocalGroups {
  std::vector<RowRange> rows;        // per local group, clipped to M
  std::vector<int64_t> first_block;  // per local group: its first token block
  RowRange owned;                    // rows owned by the window's groups; the rest is padding
};

inline LocalGroups local_groups(const IndexArray& sizes, const IndexArray& offset, int64_t num_local,
                                int64_t m) {
  const int64_t group_offset = read_group_offset(offset);
  const GroupWindow w = group_window(group_offset, num_local, sizes.count);
  std::vector<int64_t> boundary(w.last - w.first + 1);
  window_row_boundaries(sizes, w, m, boundary.data());
  LocalGroups g;
  g.owned = owned_rows(boundary.data(), w);
  int64_t block = 0;
  for (int64_t l = 0; l < num_local; ++l) {
    g.rows.push_back(local_group_rows(boundary.data(), w, group_offset, l));
    g.first_block.push_back(block);
    block += fp8_blocks(g.rows.back().rows());
  }
  return g;
}

}  // namespace cpu
}  // namespace groupgemm
