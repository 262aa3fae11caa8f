// The row range of each local group of an FP8 call on the CPU (row_plan.h), and the first
// token block of each group.
#pragma once

#include <cstdint>
#include <vector>

#include "groupgemm/fp8_blocks.h"
#include "row_plan.h"

namespace groupgemm {
namespace cpu {

struct LocalGroups {
  std::vector<RowRange> rows;        // per local group, clipped to M
  std::vector<int64_t> first_block;  // per local group: its first token block
  RowRange owned;                    // rows owned by the window's groups; the rest is padding
};

inline LocalGroups local_groups(const IndexArray& sizes, const IndexArray& offset, int64_t num_local,
                                int64_t m) {
  const RowPlan plan(sizes, offset, num_local, m);
  LocalGroups g;
  g.owned = plan.owned();
  int64_t block = 0;
  for (int64_t l = 0; l < num_local; ++l) {
    g.rows.push_back(plan.group(l));
    g.first_block.push_back(block);
    block += fp8_blocks(g.rows.back().rows());
  }
  return g;
}

}  // namespace cpu
}  // namespace groupgemm
