// The argument checks of the expert layer's entry points (api.cpp, expert_mlp_api.cpp):
// only host-visible facts, each rule written once.
#pragma once

#include <initializer_list>
#include <limits>
#include <string>
#include <utility>

#include "groupgemm/activation.h"
#include "groupgemm/types.h"

namespace groupgemm {

inline Status check_non_negative(std::initializer_list<std::pair<const char*, int64_t>> dims,
                                 const char* op) {
  for (const auto& [name, value] : dims)
    if (value < 0)
      return Status::Invalid(std::string(op) + ": " + name + " must be non-negative, got " +
                             std::to_string(value));
  return Status::Ok();
}

inline Status check_device_dtype(DType t, Device device) {
  if (t == DType::f64 && device != Device::cpu) return Status::Invalid("float64 is supported on CPU only");
  return Status::Ok();
}

// row_map and group_sizes hold rows as int32: T * k slots must fit. Compared by division,
// so no product overflows.
inline Status check_slots(int64_t num_tokens, int64_t top_k) {
  const int64_t limit = std::numeric_limits<int32_t>::max();
  if (top_k > 0 && num_tokens > limit / top_k)
    return Status::Invalid("T * k = " + std::to_string(num_tokens) + " * " + std::to_string(top_k) +
                           " slots do not fit row_map's int32 rows (at most 2^31 - 1)");
  return Status::Ok();
}

// probs (and dprobs) are in the values' dtype or float32.
inline Status check_probs_dtype(bool has_probs, DType probs_dtype, DType dtype) {
  if (has_probs && probs_dtype != dtype && probs_dtype != DType::f32)
    return Status::Invalid(std::string("probs must be ") + dtype_name(dtype) +
                           (dtype == DType::f32 ? "" : " or float32") + ", got " + dtype_name(probs_dtype));
  return Status::Ok();
}

// `holder` names the array whose F_in columns the activation takes (h; w_in for the fused MLP).
inline Status check_activation(Activation kind, int64_t in_features, const char* holder = "h") {
  if (!valid_activation(kind))
    return Status::Invalid("kind must be swiglu, gelu, relu or silu, got " +
                           std::to_string(static_cast<int>(kind)));
  if (kind == Activation::swiglu && in_features % 2 != 0)
    return Status::Invalid(std::string(holder) + " has " + std::to_string(in_features) +
                           " columns; swiglu needs an even count (gate and up halves)");
  return Status::Ok();
}

}  // namespace groupgemm
