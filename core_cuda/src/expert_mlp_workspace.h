// The CUDA backend's workspace of the fused expert MLP (groupgemm/expert_mlp.h): the
// routing's arrays, which its sort kernels write from the device-resident expert ids; each
// grouped GEMM's per-expert problems, pointers, leading dimensions and gather indices, which
// its setup kernel writes from the routing; and the call's row scratch (fc1's output and the
// activation in the forward; fc2's unweighted input gradient, the activation and the two
// layers' output gradients in the backward), rows in routing order. The caller provides
// the memory, so nothing is allocated at run time and a CUDA graph can replay the call.
//
// The layout and the views are __host__ __device__, so the core tests run the CUDA call
// sequence (expert_mlp_sequence.h) on the host over the same bytes.
#pragma once

#include <cstdint>

#include "groupgemm/expert_mlp.h"
#include "workspace.h"

namespace groupgemm {

// A forward writes two grouped GEMMs' arrays (fc1, fc2), a backward four (fc2's input
// gradient, the two weight gradients, fc1's input gradient).
constexpr int kExpertGemmSets = 4;

// What the workspace's size depends on: T * k slots, E local experts, H, F_in and the
// activation's F columns, the values' element size, and whether the call is a backward.
struct ExpertMlpShape {
  int64_t num_slots, num_experts, hidden, in_features, out_features, value_bytes;
  bool backward;
};

// Byte offsets, each 16-byte aligned.
struct ExpertMlpLayout {
  int64_t chunks;        // C: the slot chunks of the counting sort
  int64_t kept_rows;     // int32: rows of kept slots
  int64_t bucket_start;  // int32[E + 1]: each local expert's first row, then the dropped bucket's
  int64_t counts;        // int32[(E + 1) C]
  int64_t row_map;       // int32[T * k]: each slot's row, -1 when dropped
  int64_t slot_of_row;   // int32[T * k]: each kept row's slot
  int64_t token_of_row;  // int32[T * k]: each kept row's token (the gather indices)
  GemmArraysLayout gemm[kExpertGemmSets];
  int64_t gather[kExpertGemmSets];  // const int32_t*[E] each: an expert's gather indices, or null
  // Row scratch, [T * k] rows each (0 bytes where the call has none):
  int64_t fc1_rows;  // values [F_in]: the forward's fc1 output; the backward's fc1 output gradient
  int64_t act_rows;  // values [F]: the activation
  int64_t grad_rows;  // float32 [F]: the backward's dout @ w_out^T, unweighted
  int64_t dy_rows;    // values [H]: the backward's fc2 output gradient, probs * dout
  int64_t bytes;      // total size
};

GG_HD ExpertMlpLayout expert_mlp_layout(const ExpertMlpShape& s) {
  const int64_t slots = s.num_slots, e = s.num_experts;
  ExpertMlpLayout l{};
  int64_t at = 0;
  auto take = [&at](int64_t bytes) {
    const int64_t here = at;
    at += align16(bytes);
    return here;
  };
  l.chunks = permute_chunks(slots, e);
  l.kept_rows = take(4);
  l.bucket_start = take((e + 1) * 4);
  l.counts = take(count_entries(e, l.chunks) * 4);
  l.row_map = take(slots * 4);
  l.slot_of_row = take(slots * 4);
  l.token_of_row = take(slots * 4);
  for (int set = 0; set < kExpertGemmSets; ++set) {
    GemmArraysLayout& g = l.gemm[set];
    g.action = take(e * 4);
    g.problem = take(e * 3 * 4);
    for (int i = 0; i < 4; ++i) g.ptr[i] = take(e * 8);
    for (int i = 0; i < 4; ++i) g.ld[i] = take(e * 8);
    l.gather[set] = take(e * 8);
  }
  l.fc1_rows = take(slots * s.in_features * s.value_bytes);
  l.act_rows = take(slots * s.out_features * s.value_bytes);
  l.grad_rows = take(s.backward ? slots * s.out_features * 4 : 0);
  l.dy_rows = take(s.backward ? slots * s.hidden * s.value_bytes : 0);
  l.bytes = at;
  return l;
}

// Typed views of the workspace at `base`.
struct ExpertMlpView {
  int32_t* kept_rows;
  int32_t* bucket_start;
  int32_t* counts;
  int32_t* row_map;
  int32_t* slot_of_row;
  int32_t* token_of_row;
  GemmArrays gemm[kExpertGemmSets];
  const int32_t** gather[kExpertGemmSets];
  void* fc1_rows;
  void* act_rows;
  float* grad_rows;
  void* dy_rows;
};

GG_HD ExpertMlpView expert_mlp_view(void* base, const ExpertMlpShape& s) {
  const ExpertMlpLayout l = expert_mlp_layout(s);
  char* b = static_cast<char*>(base);
  auto i32 = [b](int64_t at) { return reinterpret_cast<int32_t*>(b + at); };
  ExpertMlpView v{};
  v.kept_rows = i32(l.kept_rows), v.bucket_start = i32(l.bucket_start), v.counts = i32(l.counts);
  v.row_map = i32(l.row_map), v.slot_of_row = i32(l.slot_of_row), v.token_of_row = i32(l.token_of_row);
  for (int set = 0; set < kExpertGemmSets; ++set) {
    v.gemm[set].action = i32(l.gemm[set].action);
    v.gemm[set].problem = i32(l.gemm[set].problem);
    for (int i = 0; i < 4; ++i) {
      v.gemm[set].ptr[i] = reinterpret_cast<void**>(b + l.gemm[set].ptr[i]);
      v.gemm[set].ld[i] = reinterpret_cast<int64_t*>(b + l.gemm[set].ld[i]);
    }
    v.gather[set] = reinterpret_cast<const int32_t**>(b + l.gather[set]);
  }
  v.fc1_rows = b + l.fc1_rows, v.act_rows = b + l.act_rows;
  v.grad_rows = reinterpret_cast<float*>(b + l.grad_rows), v.dy_rows = b + l.dy_rows;
  return v;
}

}  // namespace groupgemm
