// How the CPU backend's elementwise steps read and write the storage dtypes (widened to
// float, double for float64, computed there and rounded once on the way out) and when
// they split rows over threads.
#pragma once

#include <cstdint>
#include <type_traits>

#include "convert.h"

namespace groupgemm {
namespace cpu {

// The arithmetic type of a storage type: double for float64, float otherwise.
template <typename T>
using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename A, typename T>
A load(const T* p, int64_t i) {
  return static_cast<A>(widen(p[i]));
}

template <typename T, typename A>
T store(A v) {
  if constexpr (std::is_same_v<T, double>)
    return static_cast<double>(v);
  else
    return narrow<T>(static_cast<float>(v));
}

// Calls fn(T{}, P{}) with the storage types of the values and of probs (when given).
template <typename Fn>
Status visit_values_and_probs(DType values, DType probs, Fn&& fn) {
  return visit_dtype(values, [&](auto v) { return visit_dtype(probs, [&](auto p) { return fn(v, p); }); });
}

// Rows split over threads when there are enough of them to pay for the team.
inline bool parallel_rows(int64_t rows, int64_t row_elements) {
  return rows > 1 && rows * row_elements >= 16384;
}

}  // namespace cpu
}  // namespace groupgemm
