// Host conversions between the storage dtypes and float, round-to-nearest-even.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "groupgemm/types.h"

namespace groupgemm {
namespace cpu {

struct bf16_t {
  uint16_t bits;
};
using f16_t = _Float16;  // IEEE binary16 with correctly rounded conversions (GCC >= 12)

inline float widen(float v) { return v; }
inline double widen(double v) { return v; }
inline float widen(f16_t v) { return static_cast<float>(v); }
inline float widen(bf16_t v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
T narrow(float v);
template <>
inline float narrow<float>(float v) {
  return v;
}
template <>
inline f16_t narrow<f16_t>(float v) {
  return static_cast<f16_t>(v);
}
// A NaN stays a (quiet) NaN. Both results are computed and one selected, without a branch,
// so that loops of conversions vectorize.
template <>
inline bf16_t narrow<bf16_t>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet_nan = (u >> 16) | 0x40u;
  return {static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded)};
}

// Calls fn with a value of the C++ storage type of `t` (only its type matters).
template <typename Fn>
auto visit_dtype(DType t, Fn&& fn) {
  switch (t) {
    case DType::bf16: return fn(bf16_t{});
    case DType::f16: return fn(f16_t{});
    case DType::f64: return fn(double{});
    case DType::f32: break;
  }
  return fn(float{});
}

// Converts `count` elements between dtypes (exact when widening).
inline void convert(const void* src, DType src_t, void* dst, DType dst_t, int64_t count) {
  visit_dtype(src_t, [&](auto s) {
    using S = decltype(s);
    visit_dtype(dst_t, [&](auto d) {
      using D = decltype(d);
      const S* in = static_cast<const S*>(src);
      D* out = static_cast<D*>(dst);
      for (int64_t i = 0; i < count; ++i) {
        if constexpr (std::is_same_v<D, double>)
          out[i] = static_cast<double>(widen(in[i]));
        else if constexpr (std::is_same_v<S, double>)
          out[i] = narrow<D>(static_cast<float>(in[i]));
        else
          out[i] = narrow<D>(widen(in[i]));
      }
      return 0;
    });
    return 0;
  });
}

}  // namespace cpu
}  // namespace groupgemm
