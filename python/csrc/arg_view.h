// One view of an array argument, whichever binding made it: the PyTorch frontend's
// DLPack arrays (torch_ext/csrc/array_args.h) and XLA's FFI buffers
// (jax_ext/csrc/ffi_handlers.cpp) both become ArgViews, and each op's arguments are
// unpacked from views once, for both (op_table.h; gemm_ops.cpp, expert_ops.cpp,
// fp8_ops.cpp). The core gets pointers and sizes only, so the unpacking checks every
// buffer against the sizes it hands the core; the core checks the sizes themselves. A
// refused argument is an ArgError naming it, which each binding raises its own way.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>

#include "dtype_table.h"
#include "groupgemm/fp8.h"
#include "groupgemm/groupgemm.h"

namespace groupgemm {
namespace glue {

// What an array's elements are: one of the core's float dtypes, or another kind the ops read.
enum class Element : uint8_t { floating, int32, int64, uint8, float8_e4m3, float8_e5m2, other };

struct ArgView {
  static constexpr int kMaxRank = 8;
  const char* name = "";
  void* data = nullptr;
  Element element = Element::other;
  DType dtype = DType::f32;  // when element is floating
  int rank = -1;             // -1: an optional argument that was not given
  int64_t dims[kMaxRank] = {};

  bool given() const { return rank >= 0; }
  int64_t count() const {
    int64_t c = 1;
    for (int i = 0; i < rank; ++i) c *= dims[i];
    return c;
  }
};

// A refused argument. wrong_type: the bindings raise TypeError (else ValueError, or XLA's
// invalid-argument error).
struct ArgError : std::invalid_argument {
  ArgError(const std::string& message, bool wrong_type)
      : std::invalid_argument(message), wrong_type(wrong_type) {}
  bool wrong_type;
};

// The bytes of one element; 0 for an element of no known size.
inline int64_t element_bytes(const ArgView& v) {
  switch (v.element) {
    case Element::floating: return dtype_size(v.dtype);
    case Element::int32: return 4;
    case Element::int64: return 8;
    case Element::uint8:
    case Element::float8_e4m3:
    case Element::float8_e5m2: return 1;
    case Element::other: return 0;
  }
  return 0;
}

[[noreturn]] inline void refuse(const ArgView& v, const std::string& what, bool wrong_type = false) {
  throw ArgError(std::string(v.name) + " " + what, wrong_type);
}

inline void expect_rank(const ArgView& v, int rank) {
  if (v.rank != rank) refuse(v, "must have rank " + std::to_string(rank) + ", got " + std::to_string(v.rank));
}

inline void expect_dim(const ArgView& v, int axis, int64_t want) {
  if (v.dims[axis] != want)
    refuse(v, "dimension " + std::to_string(axis) + " is " + std::to_string(v.dims[axis]) + ", expected " +
                  std::to_string(want));
}

// Rank and every dimension.
inline void expect_shape(const ArgView& v, std::initializer_list<int64_t> shape) {
  expect_rank(v, static_cast<int>(shape.size()));
  int axis = 0;
  for (int64_t want : shape) expect_dim(v, axis++, want);
}

inline void expect_count(const ArgView& v, int64_t want) {
  if (v.count() != want)
    refuse(v, "has " + std::to_string(v.count()) + " elements, expected " + std::to_string(want));
}

inline DType float_dtype(const ArgView& v) {
  if (v.element != Element::floating) refuse(v, "must be " + accepted_dtype_names(), true);
  return v.dtype;
}

// A float array whose dtype is another argument's.
inline void expect_dtype(const ArgView& v, DType want, const char* of) {
  if (float_dtype(v) != want)
    refuse(v, std::string("must have the dtype of ") + of + " (" + dtype_name(want) + ")", true);
}

// Group sizes, or cumulative group ends (IndexArray::cumulative).
inline IndexArray index_array(const ArgView& v, bool cumulative = false) {
  if (v.element != Element::int32 && v.element != Element::int64) refuse(v, "must be int32 or int64", true);
  return {v.data, v.element == Element::int32 ? IndexType::i32 : IndexType::i64, v.count(), cumulative};
}

// group_offset: absent, or one index.
inline IndexArray optional_offset(const ArgView& v) {
  if (!v.given()) return {};
  if (v.count() != 1) refuse(v, "must be a scalar");
  return index_array(v);
}

inline int32_t* int32_data(const ArgView& v) {
  if (v.element != Element::int32) refuse(v, "must be int32", true);
  return static_cast<int32_t*>(v.data);
}

// A float8 operand: an XLA float8 buffer names its format; a DLPack array arrives as its
// uint8 bytes with the format given beside it (`declared`).
inline Fp8Type fp8_operand(const ArgView& v, std::optional<Fp8Type> declared) {
  if (v.element == Element::float8_e4m3) return Fp8Type::e4m3;
  if (v.element == Element::float8_e5m2) return Fp8Type::e5m2;
  if (v.element != Element::uint8 || !declared)
    refuse(v, declared ? "must be the uint8 bytes of a float8 array" : "must be float8", true);
  return *declared;
}

// An FP8 scale: float32, `count` of them.
inline float* fp8_scale(const ArgView& v, int64_t count) {
  if (v.element != Element::floating || v.dtype != DType::f32) refuse(v, "must be float32", true);
  expect_count(v, count);
  return static_cast<float*>(v.data);
}

}  // namespace glue
}  // namespace groupgemm
