// The row ranges of the local groups of one call on the CPU: the schedule
// (groupgemm/schedule.h) walked on the host, for the GEMMs and the FP8 calls alike.
#pragma once

#include <cstdint>
#include <vector>

#include "groupgemm/schedule.h"

namespace groupgemm {
namespace cpu {

class RowPlan {
 public:
  RowPlan(const IndexArray& sizes, const IndexArray& offset, int64_t num_local, int64_t m)
      : offset_(read_group_offset(offset)),
        window_(group_window(offset_, num_local, sizes.count)),
        boundary_(window_.last - window_.first + 1) {
    window_row_boundaries(sizes, window_, m, boundary_.data());
  }
  RowRange group(int64_t local) const { return local_group_rows(boundary_.data(), window_, offset_, local); }
  RowRange owned() const { return owned_rows(boundary_.data(), window_); }

 private:
  int64_t offset_;
  GroupWindow window_;
  std::vector<int64_t> boundary_;
};

}  // namespace cpu
}  // namespace groupgemm
