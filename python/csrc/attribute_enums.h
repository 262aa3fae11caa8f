// The ops' enumerated attributes, each value named once: module.cpp binds them as Python
// IntEnums (groupgemm._core.Activation, Fp8Type, Fp8Scaling) and OpCall::enumerated
// (op_table.h) refuses any other value, as given, before it becomes the enum: an int64
// attribute cast straight to a 32-bit enum would read 2**32 as 0.
#pragma once

#include <string>

#include "groupgemm/fp8.h"
#include "groupgemm/types.h"

namespace groupgemm {
namespace glue {

struct Enumerator {
  const char* name;
  int value;
  const char* doc;
};

// Enumerators<Enum>::values: every value an attribute of that enum may take.
template <typename Enum>
struct Enumerators;

template <>
struct Enumerators<Activation> {
  static constexpr const char* type_name = "Activation";
  static constexpr const char* doc = "The expert MLP's activation.";
  static constexpr Enumerator values[] = {
      {"swiglu", static_cast<int>(Activation::swiglu), "silu(h[:, :F]) * h[:, F:]"},
      {"gelu", static_cast<int>(Activation::gelu), "exact (erf) gelu"},
      {"relu", static_cast<int>(Activation::relu), "max(x, 0)"},
      {"silu", static_cast<int>(Activation::silu), "x * sigmoid(x)"},
  };
};

template <>
struct Enumerators<Fp8Type> {
  static constexpr const char* type_name = "Fp8Type";
  static constexpr const char* doc = "A float8 format.";
  static constexpr Enumerator values[] = {
#define GG_FP8_ENUMERATOR_ROW(id, name, bias, mantissa, max_value, max_bits) \
  {#id, static_cast<int>(Fp8Type::id), name},
      GROUPGEMM_FP8_TYPES(GG_FP8_ENUMERATOR_ROW)
#undef GG_FP8_ENUMERATOR_ROW
  };
};

template <>
struct Enumerators<Fp8Scaling> {
  static constexpr const char* type_name = "Fp8Scaling";
  static constexpr const char* doc = "How FP8 scales are laid over an operand.";
  static constexpr Enumerator values[] = {
      {"rowwise", static_cast<int>(Fp8Scaling::rowwise), "one scale per row (channel)"},
      {"blockwise", static_cast<int>(Fp8Scaling::blockwise), "one scale per 128-long block"},
  };
};

// "0 (swiglu), 1 (gelu), 2 (relu) or 3 (silu)": the values a refusal lists.
template <typename Enum>
std::string enumerator_list() {
  std::string listed;
  const auto& values = Enumerators<Enum>::values;
  const size_t count = sizeof(values) / sizeof(values[0]);
  for (size_t i = 0; i < count; ++i) {
    listed += i == 0 ? "" : i + 1 == count ? " or " : ", ";
    listed += std::to_string(values[i].value) + " (" + values[i].name + ")";
  }
  return listed;
}

}  // namespace glue
}  // namespace groupgemm
