// unpermute and its backward on the device, with groupgemm/permute.h's per-element
// rules: the same slot order, float32 arithmetic without fused multiply-adds, and the
// same fixed lane order for dprobs as the CPU backend, so both give the same bits. The
// backward's rows find their slots in the slots sorted by row (counting_sort.cuh's radix
// passes, in the caller's workspace), so a row named twice gets both terms, in order.
#include "counting_sort.cuh"
#include "dtypes.cuh"
#include "groupgemm/permute.h"
#include "expert_kernels.h"
#include "permute_workspace.h"

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

// One block per row of dpermuted (striding over them), its threads over columns: the row's
// slots by binary search in the sorted slots (every thread alike), then their sum in
// order; a row with no slot gets exact zeros. `sorted` may be null when there is no slot.
template <typename T, typename P>
__global__ void row_gradient_kernel(const T* dout, const int32_t* row_map, const int32_t* sorted,
                                    const P* probs, T* dpermuted, int64_t num_rows, int64_t slots,
                                    int64_t top_k, int64_t hidden) {
  for (int64_t r = blockIdx.x; r < num_rows; r += gridDim.x) {
    const RowRange row = row_slots(row_map, sorted, slots, num_rows, r);
    auto prob = [&](int64_t s) { return probs ? float(probs[s]) : 1.0f; };
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      auto grad = [&](int64_t t) { return float(dout[t * hidden + h]); };
      dpermuted[r * hidden + h] = T(row_gradient<float>(sorted, row, top_k, grad, prob));
    }
  }
}

// One warp per slot: dprobs in permute.h's fixed lane order, lane l over columns l,
// l + 32, ..., then the halving fold.
template <typename T, typename P>
__global__ void slot_dot_kernel(const T* dout, const T* permuted, const int32_t* row_map, P* dprobs,
                                int64_t num_rows, int64_t slots, int64_t top_k, int64_t hidden) {
  for (int64_t s = blockIdx.x; s < slots; s += gridDim.x) {
    const int64_t t = s / top_k, row = row_map[s];
    float dot = 0.0f;  // a dropped slot's dprobs is exactly 0
    if (maps_to_row(row, num_rows)) {
      auto x = [&](int64_t h) { return float(permuted[row * hidden + h]); };
      auto y = [&](int64_t h) { return float(dout[t * hidden + h]); };
      dot = dot_lane_partial<float>(threadIdx.x, hidden, x, y);
      for (int offset = kDotLanes / 2; offset > 0; offset /= 2)
        dot = dot + __shfl_down_sync(0xffffffffu, dot, offset);
    }
    if (threadIdx.x == 0) dprobs[s] = P(dot);
  }
}

// The slots sorted by row (row_sort_passes radix passes of the counting sort); returns
// the buffer holding them.
Status sort_slots_by_row(const UnpermuteBackwardArgs& a, void* workspace, const int32_t** sorted,
                         cudaStream_t stream) {
  const int64_t slots = a.num_tokens * a.top_k;
  const RowSortWorkspaceLayout l = row_sort_workspace_layout(slots);
  char* base = static_cast<char*>(workspace);
  int32_t* bucket_start = reinterpret_cast<int32_t*>(base + l.bucket_start);
  int32_t* counts = reinterpret_cast<int32_t*>(base + l.counts);
  int32_t* orders[2] = {reinterpret_cast<int32_t*>(base + l.order[0]),
                        reinterpret_cast<int32_t*>(base + l.order[1])};
  const int32_t* order = nullptr;
  for (int pass = 0; pass < row_sort_passes(a.num_rows); ++pass) {
    int32_t* next = orders[pass % 2];
    GG_RETURN_IF_ERROR(launch_counting_sort(RowDigit{a.row_map, order, a.num_rows, kRowDigitBits * pass},
                                            slots, kRowDigitBuckets, l.chunks, counts, bucket_start,
                                            NextOrder{order, next}, nullptr, nullptr, stream));
    order = next;
  }
  *sorted = order;
  return Status::Ok();
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

Status launch_unpermute_backward(const UnpermuteBackwardArgs& a, void* workspace, cudaStream_t stream) {
  const int64_t slots = a.num_tokens * a.top_k;
  const DType probs_dtype = a.probs || a.dprobs ? a.probs_dtype : a.dtype;
  return visit_cuda_dtypes(a.dtype, probs_dtype, [&](auto t_tag, auto p_tag) -> Status {
    using T = decltype(t_tag);
    using P = decltype(p_tag);
    if (a.dpermuted && a.num_rows * a.hidden > 0) {
      const int32_t* sorted = nullptr;
      if (slots > 0) GG_RETURN_IF_ERROR(sort_slots_by_row(a, workspace, &sorted, stream));
      row_gradient_kernel<T, P><<<row_blocks(a.num_rows), kThreads, 0, stream>>>(
          static_cast<const T*>(a.dout), a.row_map, sorted, static_cast<const P*>(a.probs),
          static_cast<T*>(a.dpermuted), a.num_rows, slots, a.top_k, a.hidden);
      GG_RETURN_IF_ERROR(last_launch("the unpermute backward row kernel"));
    }
    if (!a.dprobs || slots == 0) return Status::Ok();
    slot_dot_kernel<T, P><<<row_blocks(slots), kDotLanes, 0, stream>>>(
        static_cast<const T*>(a.dout), static_cast<const T*>(a.permuted), a.row_map,
        static_cast<P*>(a.dprobs), a.num_rows, slots, a.top_k, a.hidden);
    return last_launch("the unpermute backward dprobs kernel");
  });
}

}  // namespace cuda
}  // namespace groupgemm
