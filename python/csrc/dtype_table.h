// The floating-point dtypes the bindings accept, one row each: the core's DType, how a
// DLPack array (array_args.h) and an XLA FFI buffer (ffi_handlers.cpp) spell it.
// The rows follow the core's dtype list (types.h), one per dtype.
#pragma once

#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <string>

#include "groupgemm/types.h"
#include "xla/ffi/api/ffi.h"

namespace groupgemm {

struct DTypeRow {
  DType dtype;
  nanobind::dlpack::dtype_code dlpack_code;
  uint8_t dlpack_bits;
  xla::ffi::DataType xla;
};

inline constexpr DTypeRow kDTypeRows[] = {
    {DType::f32, nanobind::dlpack::dtype_code::Float, 32, xla::ffi::DataType::F32},
    {DType::bf16, nanobind::dlpack::dtype_code::Bfloat, 16, xla::ffi::DataType::BF16},
    {DType::f16, nanobind::dlpack::dtype_code::Float, 16, xla::ffi::DataType::F16},
    {DType::f64, nanobind::dlpack::dtype_code::Float, 64, xla::ffi::DataType::F64},
};

constexpr bool rows_follow_core_dtypes() {
  if (sizeof(kDTypeRows) / sizeof(kDTypeRows[0]) != static_cast<size_t>(kNumDTypes)) return false;
  for (int i = 0; i < kNumDTypes; ++i)
    if (static_cast<int>(kDTypeRows[i].dtype) != i) return false;
  return true;
}
static_assert(rows_follow_core_dtypes(), "kDTypeRows needs one row per core dtype, in types.h's order");

inline std::optional<DType> dtype_from_dlpack(nanobind::dlpack::dtype t) {
  if (t.lanes != 1) return std::nullopt;
  for (const DTypeRow& row : kDTypeRows)
    if (t.code == static_cast<uint8_t>(row.dlpack_code) && t.bits == row.dlpack_bits) return row.dtype;
  return std::nullopt;
}

inline std::optional<DType> dtype_from_xla(xla::ffi::DataType t) {
  for (const DTypeRow& row : kDTypeRows)
    if (t == row.xla) return row.dtype;
  return std::nullopt;
}

// "float32, bfloat16, float16 or float64": the accepted dtypes, for messages.
inline const std::string& accepted_dtype_names() {
  static const std::string names = [] {
    std::string s;
    const size_t count = sizeof(kDTypeRows) / sizeof(kDTypeRows[0]);
    for (size_t i = 0; i < count; ++i) {
      if (i > 0) s += i + 1 == count ? " or " : ", ";
      s += dtype_name(kDTypeRows[i].dtype);
    }
    return s;
  }();
  return names;
}

}  // namespace groupgemm
