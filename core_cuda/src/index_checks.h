// The group-count rule of every grouped call, as the core checks it: without
// group_offset, group_sizes has one entry per local group; with it, at least that many.
// (api.cpp's GEMM entry points state the same rule in their own copy.)
#pragma once

#include <string>

#include "groupgemm/types.h"

namespace groupgemm {

inline Status check_group_counts(const IndexArray& sizes, const IndexArray& offset, int64_t num_groups) {
  const auto str = [](int64_t v) { return std::to_string(v); };
  if (sizes.count < 0 || (sizes.count > 0 && sizes.data == nullptr))
    return Status::Invalid("group_sizes is missing");
  if (offset.data == nullptr) {
    if (sizes.count != num_groups)
      return Status::Invalid("group_sizes has " + str(sizes.count) + " entries but there are " +
                             str(num_groups) + " groups; pass group_offset to select a window");
  } else {
    if (offset.count != 1) return Status::Invalid("group_offset must be a scalar");
    if (sizes.count < num_groups)
      return Status::Invalid("group_sizes has " + str(sizes.count) + " entries, fewer than the " +
                             str(num_groups) + " local groups");
  }
  return Status::Ok();
}

}  // namespace groupgemm
