// DType -> device element type (CUTLASS's numeric types, which convert to and from float
// with round-to-nearest-even).
#pragma once

#include "cutlass/bfloat16.h"
#include "cutlass/half.h"
#include "groupgemm/types.h"

namespace groupgemm {
namespace cuda {

// Calls fn(T{}) for the element type of a CUDA-supported dtype (float64 is CPU-only and
// rejected before any backend runs).
template <typename Fn>
auto visit_cuda_dtype(DType t, Fn&& fn) {
  switch (t) {
    case DType::bf16: return fn(cutlass::bfloat16_t{});
    case DType::f16: return fn(cutlass::half_t{});
    default: return fn(float{});
  }
}

// Calls fn(In{}, Out{}) for an input and an output dtype.
template <typename Fn>
auto visit_cuda_dtypes(DType in, DType out, Fn&& fn) {
  return visit_cuda_dtype(in, [&](auto in_tag) {
    return visit_cuda_dtype(out, [&](auto out_tag) { return fn(in_tag, out_tag); });
  });
}

}  // namespace cuda
}  // namespace groupgemm
