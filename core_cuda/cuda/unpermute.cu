// unpermute and its backward on the device, with groupgemm/permute.h's per-element
// rules: the same slot order, float32 arithmetic without fused multiply-adds, and the
// same fixed lane order for dprobs as the CPU backend, so both give the same bits.
#include <string>

#include "dtypes.cuh"
#include "groupgemm/permute.h"
#include "kernels.h"
#include "moe_kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

// Tokens (or slots) per grid: each block strides over them, its threads over columns.
unsigned row_blocks(int64_t rows) { return grid_dim(rows, 65536); }

// Calls fn(T{}, P{}) for the values' and the probs' element types (P = T without probs).
template <typename Fn>
Status visit_values_and_probs(DType values, const void* probs, DType probs_dtype, Fn&& fn) {
  return visit_cuda_dtypes(values, probs ? probs_dtype : values, fn);
}

template <typename T, typename P>
__global__ void unpermute_kernel(const T* permuted, const int32_t* row_map, const P* probs, T* out,
                                 int64_t num_rows, int64_t num_tokens, int64_t top_k, int64_t hidden) {
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const int32_t* row_map_t = row_map + t * top_k;
    auto prob = [&](int64_t j) { return probs ? float(probs[t * top_k + j]) : 1.0f; };
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      auto value = [&](int64_t r) { return float(permuted[r * hidden + h]); };
      out[t * hidden + h] = T(unpermute_sum<float>(row_map_t, top_k, num_rows, value, prob));
    }
  }
}

// One block per slot: every thread writes part of the slot's dpermuted row; the first
// warp reduces the slot's dprobs, lane l over columns l, l + 32, ..., then the halving fold.
template <typename T, typename P>
__global__ void unpermute_backward_kernel(const T* dout, const T* permuted, const int32_t* row_map,
                                          const P* probs, T* dpermuted, P* dprobs, int64_t num_rows,
                                          int64_t slots, int64_t top_k, int64_t hidden) {
  for (int64_t s = blockIdx.x; s < slots; s += gridDim.x) {
    const int64_t t = s / top_k, row = row_map[s];
    const bool mapped = maps_to_row(row, num_rows);
    if (mapped) {
      const float p = probs ? float(probs[s]) : 1.0f;
      for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x)
        dpermuted[row * hidden + h] = T(__fmul_rn(p, float(dout[t * hidden + h])));
    }
    if (probs && threadIdx.x < kDotLanes) {
      float dot = 0.0f;  // a dropped slot's dprobs is exactly 0
      if (mapped) {
        auto x = [&](int64_t h) { return float(permuted[row * hidden + h]); };
        auto y = [&](int64_t h) { return float(dout[t * hidden + h]); };
        dot = dot_lane_partial<float>(threadIdx.x, hidden, x, y);
        for (int offset = kDotLanes / 2; offset > 0; offset /= 2)
          dot = dot + __shfl_down_sync(0xffffffffu, dot, offset);
      }
      if (threadIdx.x == 0) dprobs[s] = P(dot);
    }
  }
}

}  // namespace

Status launch_unpermute(const UnpermuteArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0 || a.hidden == 0) return Status::Ok();
  return visit_values_and_probs(a.dtype, a.probs, a.probs_dtype, [&](auto t_tag, auto p_tag) {
    using T = decltype(t_tag);
    using P = decltype(p_tag);
    unpermute_kernel<T, P><<<row_blocks(a.num_tokens), kThreads, 0, stream>>>(
        static_cast<const T*>(a.permuted), a.row_map, static_cast<const P*>(a.probs), static_cast<T*>(a.out),
        a.num_rows, a.num_tokens, a.top_k, a.hidden);
    return last_launch("the unpermute kernel");
  });
}

Status launch_unpermute_backward(const UnpermuteBackwardArgs& a, cudaStream_t stream) {
  const int64_t row_bytes = a.hidden * dtype_size(a.dtype);
  // Rows no slot maps to stay exactly zero; the kernel then overwrites the mapped ones.
  if (a.num_rows * row_bytes > 0) {
    const cudaError_t e = cudaMemsetAsync(a.dpermuted, 0, a.num_rows * row_bytes, stream);
    if (e != cudaSuccess)
      return Status::Internal(std::string("zeroing dpermuted failed: ") + cudaGetErrorString(e));
  }
  const int64_t slots = a.num_tokens * a.top_k;
  if (slots == 0) return Status::Ok();
  return visit_values_and_probs(a.dtype, a.probs, a.probs_dtype, [&](auto t_tag, auto p_tag) {
    using T = decltype(t_tag);
    using P = decltype(p_tag);
    unpermute_backward_kernel<T, P><<<row_blocks(slots), kThreads, 0, stream>>>(
        static_cast<const T*>(a.dout), static_cast<const T*>(a.permuted), a.row_map,
        static_cast<const P*>(a.probs), static_cast<T*>(a.dpermuted), static_cast<P*>(a.dprobs), a.num_rows,
        slots, a.top_k, a.hidden);
    return last_launch("the unpermute backward kernel");
  });
}

}  // namespace cuda
}  // namespace groupgemm
