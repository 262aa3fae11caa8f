// The argument checks every entry point of the core shares (api.cpp, fp8_api.cpp), and the
// dispatch to a backend once they pass. Only host-visible facts: shapes, pointers, counts.
#pragma once

#include <string>

#include "float_mode.h"
#include "groupgemm/types.h"

namespace groupgemm {

inline Status check_dims(int64_t m, int64_t k, int64_t n, int64_t num_groups) {
  if (m < 0 || k < 0 || n < 0 || num_groups < 0)
    return Status::Invalid("dimensions must be non-negative, got M=" + std::to_string(m) +
                           " K=" + std::to_string(k) + " N=" + std::to_string(n) +
                           " G=" + std::to_string(num_groups));
  return Status::Ok();
}

// The group-count rule of every grouped call: without group_offset, group_sizes has one
// entry per local group; with it (a window of global groups), at least that many.
inline Status check_groups(const IndexArray& sizes, const IndexArray& offset, int64_t num_groups) {
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

inline Status check_ptr(const void* p, int64_t elements, const char* name) {
  if (elements > 0 && p == nullptr) return Status::Invalid(std::string(name) + " is null");
  return Status::Ok();
}

// Runs the CPU or the CUDA backend (no_cuda.cpp in builds without nvcc) for already
// validated arguments; the CPU backend in the core's floating-point mode (float_mode.h).
template <typename Args, typename Cpu, typename Cuda>
Status dispatch(const Args& args, const ExecContext& ctx, Cpu cpu_fn, Cuda cuda_fn) {
  if (ctx.device == Device::cpu) {
    const CpuFloatModeScope mode;
    return cpu_fn(args);
  }
  return cuda_fn(args, ctx);
}

}  // namespace groupgemm
