// The fused expert MLP's small kernels, each a loop over expert_mlp_sequence.h's rows or
// experts around the shared per-element rules: the routing of groupgemm/expert_mlp.h,
// the activation and its derivative of groupgemm/activation.h in float32 (rounded once, as
// the activation kernels round), and permute.h's products and fixed dot order. Rows past
// the kept ones are never read. No atomics: every output element has one writer and every
// sum a fixed order, so the results do not depend on scheduling.
#include "counting_sort.cuh"
#include "dtypes.cuh"
#include "expert_mlp_kernels.h"
#include "groupgemm/activation.h"
#include "groupgemm/expert_mlp.h"

namespace groupgemm {
namespace cuda {
namespace {

// Rows (or slots) per grid: each block strides over them, its threads over columns.
unsigned row_blocks(int64_t rows) { return grid_dim(rows, 65536); }
unsigned element_blocks(int64_t elements) { return grid_dim(ceil_div(elements, kThreads), 65536); }

__global__ void expert_setup_kernel(ExpertSetupArgs a) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < a.num_experts;
       e += int64_t(gridDim.x) * blockDim.x)
    write_expert_setup(a, e);
}

template <typename T>
__global__ void fill_rows_kernel(ExpertFillArgs a) {
  const int64_t kept = *a.kept_rows;
  T* out = static_cast<T*>(a.out);
  for (int64_t r = blockIdx.x; r < kept; r += gridDim.x) {
    const int64_t e = a.bias ? expert_of_row(a.bucket_start, a.num_experts, r) : 0;
    const T* bias = a.bias ? static_cast<const T*>(a.bias) + e * a.n : nullptr;
    for (int64_t j = threadIdx.x; j < a.n; j += blockDim.x) out[r * a.n + j] = bias ? bias[j] : T(0.0f);
  }
}

// h[s] = fc1_rows[row_map[s]], or zeros for a dropped slot.
template <typename T>
__global__ void slot_h_kernel(ForwardRowsArgs a) {
  const T* rows = static_cast<const T*>(a.fc1_rows);
  T* h = static_cast<T*>(a.h);
  for (int64_t s = blockIdx.x; s < a.num_slots; s += gridDim.x) {
    const int64_t row = a.row_map[s];
    for (int64_t j = threadIdx.x; j < a.in_features; j += blockDim.x)
      h[s * a.in_features + j] = row >= 0 ? rows[row * a.in_features + j] : T(0.0f);
  }
}

// act[r, c] for the kept rows, as the activation kernel computes it.
template <typename T>
__global__ void activation_rows_kernel(ForwardRowsArgs a) {
  const bool swiglu = a.activation == Activation::swiglu;
  const int64_t elements = *a.kept_rows * a.out_features;
  const T* rows = static_cast<const T*>(a.fc1_rows);
  T* act = static_cast<T*>(a.act_rows);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < elements;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.out_features, c = i % a.out_features;
    const T* row = rows + r * a.in_features;
    const float up = swiglu ? float(row[a.out_features + c]) : 0.0f;
    act[i] = T(activation_forward(a.activation, float(row[c]), up));
  }
}

// A warp's sum of its lanes' partial dots, in fold_dot_lanes's order (lane 0 holds it).
__device__ float fold_lanes(float partial) {
  for (int offset = kDotLanes / 2; offset > 0; offset /= 2)
    partial = partial + __shfl_down_sync(0xffffffffu, partial, offset);
  return partial;
}

constexpr int kRowWarps = kThreads / kDotLanes;

template <typename T, typename P>
__global__ void __launch_bounds__(kThreads) backward_rows_kernel(BackwardRowsArgs a) {
  const bool swiglu = a.activation == Activation::swiglu;
  const int64_t f = a.out_features, f_in = a.in_features, hidden = a.hidden;
  P* dprobs = static_cast<P*>(a.dprobs);
  if (dprobs)  // a dropped slot's weight has no effect
    for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < a.num_slots;
         s += int64_t(gridDim.x) * blockDim.x)
      if (a.row_map[s] < 0) dprobs[s] = P(0.0f);
  const int64_t kept = *a.kept_rows;
  const int lane = threadIdx.x % kDotLanes;
  const T* dout = static_cast<const T*>(a.dout);
  T* act = static_cast<T*>(a.act_rows);
  T* dy = static_cast<T*>(a.dy_rows);
  T* dh = static_cast<T*>(a.dh_rows);
  for (int64_t r = blockIdx.x * int64_t(kRowWarps) + threadIdx.x / kDotLanes; r < kept;
       r += int64_t(gridDim.x) * kRowWarps) {
    const int64_t s = a.slot_of_row[r], t = s / a.top_k;
    const float p = a.probs ? float(static_cast<const P*>(a.probs)[s]) : 1.0f;
    const T* h = static_cast<const T*>(a.h) + s * f_in;
    const float* g = a.grad_rows + r * f;
    const T* dout_t = dout + t * hidden;
    float dot = 0.0f;  // lane's terms c = lane, lane + 32, ... in order (dot_lane_partial)
    for (int64_t c = lane; c < f; c += kDotLanes) {
      const float x = float(h[c]), up = swiglu ? float(h[f + c]) : 0.0f;
      if (act || dprobs) {
        const T value = T(activation_forward(a.activation, x, up));
        if (act) act[r * f + c] = value;
        if (dprobs) dot = add_product(dot, float(value), g[c]);
      }
      if (dh) {
        const ActivationGrad<float> d = activation_backward_at(a.activation, product(p, g[c]), x, up);
        dh[r * f_in + c] = T(d.dx);
        if (swiglu) dh[r * f_in + f + c] = T(d.dup);
      }
    }
    if (dprobs) {
      dot = fold_lanes(dot);
      if (a.b_out) {
        const int64_t e = expert_of_row(a.bucket_start, a.num_experts, r);
        const T* bias = static_cast<const T*>(a.b_out) + e * hidden;
        float bias_dot = 0.0f;
        for (int64_t c = lane; c < hidden; c += kDotLanes)
          bias_dot = add_product(bias_dot, float(bias[c]), float(dout_t[c]));
        dot = dot + fold_lanes(bias_dot);
      }
      if (lane == 0) dprobs[s] = P(dot);
    }
    if (dy)
      for (int64_t c = lane; c < hidden; c += kDotLanes) dy[r * hidden + c] = T(product(p, float(dout_t[c])));
  }
}

template <typename T>
__global__ void expert_sums_kernel(ExpertSumArgs a) {
  const T* rows = static_cast<const T*>(a.rows);
  T* out = static_cast<T*>(a.out);
  for (int64_t e = blockIdx.y; e < a.num_experts; e += gridDim.y) {
    const RowRange range = expert_rows(a.bucket_start, e);
    for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < a.n;
         j += int64_t(gridDim.x) * blockDim.x) {
      float sum = 0.0f;  // an expert without rows sums to exactly 0
      for (int64_t r = range.begin; r < range.end; ++r) sum += float(rows[r * a.n + j]);
      out[e * a.n + j] = T(sum);
    }
  }
}

// Word: the widest store that every block's start and size allow.
template <typename Word>
__global__ void zero_idle_kernel(IdleFillArgs a, Word zero) {
  const int64_t words = a.block_bytes / int64_t(sizeof(Word));
  for (int64_t e = blockIdx.y; e < a.num_experts; e += gridDim.y) {
    if (expert_rows(a.bucket_start, e).rows() > 0) continue;
    Word* block = reinterpret_cast<Word*>(static_cast<char*>(a.out) + e * a.block_bytes);
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < words;
         i += int64_t(gridDim.x) * blockDim.x)
      block[i] = zero;
  }
}

}  // namespace

Status launch_expert_route(const ExpertRouteArgs& a, cudaStream_t stream) {
  const ExpertMlpView& ws = a.ws;
  return launch_counting_sort(WindowBucket{a.expert_indices, a.group_offset, a.num_experts}, a.num_slots,
                              a.num_experts + 1, a.chunks, ws.counts, ws.bucket_start,
                              RoutedSlot{ws.row_map, ws.slot_of_row, a.num_experts, ws.token_of_row, a.top_k},
                              nullptr, ws.kept_rows, stream);
}

Status launch_expert_setup(const ExpertSetupArgs& a, cudaStream_t stream) {
  if (a.num_experts == 0) return Status::Ok();
  expert_setup_kernel<<<element_blocks(a.num_experts), kThreads, 0, stream>>>(a);
  return last_launch("the expert MLP setup kernel");
}

Status launch_expert_fill_rows(const ExpertFillArgs& a, cudaStream_t stream) {
  return visit_cuda_dtype(a.dtype, [&](auto tag) {
    fill_rows_kernel<decltype(tag)><<<row_blocks(a.num_slots), kThreads, 0, stream>>>(a);
    return last_launch("the expert MLP row fill kernel");
  });
}

Status launch_forward_rows(const ForwardRowsArgs& a, cudaStream_t stream) {
  return visit_cuda_dtype(a.dtype, [&](auto tag) -> Status {
    using T = decltype(tag);
    if (a.h) {
      slot_h_kernel<T><<<row_blocks(a.num_slots), kThreads, 0, stream>>>(a);
      GG_RETURN_IF_ERROR(last_launch("the expert MLP h kernel"));
    }
    if (a.out_features == 0) return Status::Ok();
    activation_rows_kernel<T><<<element_blocks(a.num_slots * a.out_features), kThreads, 0, stream>>>(a);
    return last_launch("the expert MLP activation kernel");
  });
}

Status launch_backward_rows(const BackwardRowsArgs& a, cudaStream_t stream) {
  const DType probs_dtype = a.probs || a.dprobs ? a.probs_dtype : a.dtype;  // P = T without probs
  return visit_cuda_dtypes(a.dtype, probs_dtype, [&](auto t_tag, auto p_tag) {
    backward_rows_kernel<decltype(t_tag), decltype(p_tag)>
        <<<grid_dim(ceil_div(a.num_slots, kRowWarps), 65536), kThreads, 0, stream>>>(a);
    return last_launch("the expert MLP backward row kernel");
  });
}

Status launch_expert_sums(const ExpertSumArgs& a, cudaStream_t stream) {
  return visit_cuda_dtype(a.dtype, [&](auto tag) {
    const dim3 grid(grid_dim(ceil_div(a.n, kThreads), kMaxGridX), grid_dim(a.num_experts, kMaxGridYZ));
    expert_sums_kernel<decltype(tag)><<<grid, kThreads, 0, stream>>>(a);
    return last_launch("the expert MLP bias gradient kernel");
  });
}

Status launch_zero_idle(const IdleFillArgs& a, cudaStream_t stream) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(a.out);
  auto fits = [&](int64_t word) { return base % word == 0 && a.block_bytes % word == 0; };
  auto launch = [&](auto zero) {
    const int64_t words = a.block_bytes / int64_t(sizeof(zero));
    const dim3 grid(grid_dim(ceil_div(words, kThreads), 1024), grid_dim(a.num_experts, kMaxGridYZ));
    zero_idle_kernel<<<grid, kThreads, 0, stream>>>(a, zero);
    return last_launch("the expert MLP idle expert kernel");
  };
  if (fits(16)) return launch(make_uint4(0, 0, 0, 0));
  if (fits(4)) return launch(uint32_t(0));
  return launch(uint16_t(0));  // every dtype's element is 2 bytes or more
}

}  // namespace cuda
}  // namespace groupgemm
