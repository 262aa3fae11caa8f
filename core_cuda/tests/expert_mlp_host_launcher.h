// The fused expert MLP's CUDA kernels executed on the host, as a launcher for
// expert_mlp_sequence.h, so the core tests run the GPU's call sequence without a GPU. Each
// step reads and writes the workspace the way its kernel does: the routing's counting sort
// over the GPU's chunk count, the setup's per-expert writes, a grouped GEMM over one set's
// problems, pointers, leading dimensions and gather indices (float32 accumulation), the row
// steps with the kernels' per-element rules and dot order, the bias sums, the idle
// experts' zeros and unpermute. The launcher records what the sequence asked for.
#pragma once

#include <cstring>
#include <type_traits>
#include <vector>

#include "backends.h"
#include "convert.h"
#include "expert_mlp_sequence.h"
#include "groupgemm/activation.h"

namespace groupgemm {
namespace emulated {

// A float result stored in T, as the kernels' T(float) conversion rounds it (float64, which
// only the host runs, is visited by the dtype switches but never called on).
template <typename T>
T round_to(float v) {
  if constexpr (std::is_same_v<T, double>)
    return v;
  else
    return cpu::narrow<T>(v);
}

template <typename T>
float to_float(T v) {
  return static_cast<float>(cpu::widen(v));
}

struct ExpertLaunchRecord {
  int launches = 0;             // every step but start()
  int gemms = 0, gathered_gemms = 0, fills = 0;
  int64_t zero_k_problems = 0;  // problems with rows and k = 0 that reached a GEMM (must stay 0)
  int64_t missing_indices = 0;  // problems of a gathered GEMM without indices (must stay 0)
};

class ExpertHostLauncher {
 public:
  const ExpertLaunchRecord& record() const { return record_; }

  Status start() { return Status::Ok(); }

  Status route(const ExpertRouteArgs& a) {
    record_.launches += 4;
    const ExpertMlpView& ws = a.ws;
    counting_sort_on_host(WindowBucket{a.expert_indices, a.group_offset, a.num_experts}, a.num_slots,
                          a.num_experts + 1, a.chunks, ws.counts, ws.bucket_start,
                          RoutedSlot{ws.row_map, ws.slot_of_row, a.num_experts, ws.token_of_row, a.top_k});
    *ws.kept_rows = kept_rows_from_starts(ws.bucket_start, a.num_experts);
    return Status::Ok();
  }

  Status setup(const ExpertSetupArgs& a) {
    ++record_.launches;
    for (int64_t e = 0; e < a.num_experts; ++e) write_expert_setup(a, e);
    return Status::Ok();
  }

  Status gemm(const ExpertGemmCall& c) {
    ++record_.launches, ++record_.gemms;
    if (c.gather != Gather::none) ++record_.gathered_gemms;
    cpu::visit_dtype(c.call.in_dtype, [&](auto in_tag) {
      return cpu::visit_dtype(c.call.out_dtype, [&](auto out_tag) {
        run_gemms<decltype(in_tag), decltype(out_tag)>(c);
        return 0;
      });
    });
    return Status::Ok();
  }

  Status fill_rows(const ExpertFillArgs& a) {
    ++record_.launches, ++record_.fills;
    cpu::visit_dtype(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* bias = static_cast<const T*>(a.bias);
      T* out = static_cast<T*>(a.out);
      for (int64_t r = 0; r < *a.kept_rows; ++r) {
        const int64_t e = expert_of_row(a.bucket_start, a.num_experts, r);
        for (int64_t j = 0; j < a.n; ++j) out[r * a.n + j] = bias ? bias[e * a.n + j] : round_to<T>(0.0f);
      }
      return 0;
    });
    return Status::Ok();
  }

  Status forward_rows(const ForwardRowsArgs& a) {
    record_.launches += a.h ? 2 : 1;
    cpu::visit_dtype(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      const T* rows = static_cast<const T*>(a.fc1_rows);
      if (a.h)
        for (int64_t s = 0; s < a.num_slots; ++s)
          for (int64_t j = 0; j < a.in_features; ++j)
            static_cast<T*>(a.h)[s * a.in_features + j] =
                a.row_map[s] >= 0 ? rows[a.row_map[s] * a.in_features + j] : round_to<T>(0.0f);
      const bool swiglu = a.activation == Activation::swiglu;
      for (int64_t r = 0; r < *a.kept_rows; ++r)
        for (int64_t c = 0; c < a.out_features; ++c) {
          const T* row = rows + r * a.in_features;
          const float up = swiglu ? to_float(row[a.out_features + c]) : 0.0f;
          static_cast<T*>(a.act_rows)[r * a.out_features + c] =
              round_to<T>(activation_forward(a.activation, to_float(row[c]), up));
        }
      return 0;
    });
    return Status::Ok();
  }

  Status backward_rows(const BackwardRowsArgs& a) {
    ++record_.launches;
    cpu::visit_dtype(a.dtype, [&](auto t_tag) {
      return cpu::visit_dtype(a.probs || a.dprobs ? a.probs_dtype : a.dtype, [&](auto p_tag) {
        backward_rows<decltype(t_tag), decltype(p_tag)>(a);
        return 0;
      });
    });
    return Status::Ok();
  }

  Status expert_sums(const ExpertSumArgs& a) {
    ++record_.launches;
    cpu::visit_dtype(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      for (int64_t e = 0; e < a.num_experts; ++e) {
        const RowRange rows = expert_rows(a.bucket_start, e);
        for (int64_t j = 0; j < a.n; ++j) {
          float sum = 0.0f;
          for (int64_t r = rows.begin; r < rows.end; ++r)
            sum += to_float(static_cast<const T*>(a.rows)[r * a.n + j]);
          static_cast<T*>(a.out)[e * a.n + j] = round_to<T>(sum);
        }
      }
      return 0;
    });
    return Status::Ok();
  }

  Status zero_idle(const IdleFillArgs& a) {
    ++record_.launches;
    for (int64_t e = 0; e < a.num_experts; ++e)
      if (expert_rows(a.bucket_start, e).rows() == 0)
        std::memset(static_cast<char*>(a.out) + e * a.block_bytes, 0, a.block_bytes);
    return Status::Ok();
  }

  Status unpermute(const UnpermuteArgs& a) {
    ++record_.launches;
    return cpu::unpermute(a);  // the same per-element rule (permute.h's unpermute_sum) as the kernel
  }

 private:
  template <typename In, typename Out>
  void run_gemms(const ExpertGemmCall& c) {
    const GemmArrays& ws = c.arrays;
    const bool a_col = c.call.layout == GemmLayout::col_row, b_col = c.call.layout == GemmLayout::row_col;
    for (int64_t g = 0; g < c.call.num_groups; ++g) {
      const int64_t m = ws.problem[3 * g], n = ws.problem[3 * g + 1], k = ws.problem[3 * g + 2];
      if (m == 0 || n == 0) continue;
      if (k == 0) ++record_.zero_k_problems;
      const int32_t* index = c.gather_indices[g];
      if (c.gather != Gather::none && index == nullptr) {
        ++record_.missing_indices;
        continue;
      }
      const In* a = static_cast<const In*>(ws.ptr[0][g]);
      const In* b = static_cast<const In*>(ws.ptr[1][g]);
      const Out* src = static_cast<const Out*>(ws.ptr[2][g]);
      Out* d = static_cast<Out*>(ws.ptr[3][g]);
      const int64_t lda = ws.ld[0][g], ldb = ws.ld[1][g], ldc = ws.ld[2][g], ldd = ws.ld[3][g];
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          float acc = 0.0f;
          for (int64_t p = 0; p < k; ++p) {
            const int64_t ar = c.gather == Gather::a_rows ? index[i] : i;
            const int64_t ak = c.gather == Gather::a_k ? index[p] : p;
            const int64_t bk = c.gather == Gather::b_k ? index[p] : p;
            acc += to_float(a_col ? a[ak * lda + ar] : a[ar * lda + ak]) *
                   to_float(b_col ? b[j * ldb + bk] : b[bk * ldb + j]);
          }
          const float source = c.call.c != GemmC::none ? to_float(src[i * ldc + j]) : 0.0f;
          d[i * ldd + j] = round_to<Out>(acc + source);
        }
    }
  }

  // The kernel's warp per kept row, its lanes' partial dots folded in fold_dot_lanes's order.
  template <typename T, typename P>
  void backward_rows(const BackwardRowsArgs& a) {
    const bool swiglu = a.activation == Activation::swiglu;
    const int64_t f = a.out_features, f_in = a.in_features, hidden = a.hidden;
    P* dprobs = static_cast<P*>(a.dprobs);
    T* act = static_cast<T*>(a.act_rows);
    T* dy = static_cast<T*>(a.dy_rows);
    T* dh = static_cast<T*>(a.dh_rows);
    if (dprobs)
      for (int64_t s = 0; s < a.num_slots; ++s)
        if (a.row_map[s] < 0) dprobs[s] = round_to<P>(0.0f);
    for (int64_t r = 0; r < *a.kept_rows; ++r) {
      const int64_t s = a.slot_of_row[r], t = s / a.top_k;
      const float p = a.probs ? to_float(static_cast<const P*>(a.probs)[s]) : 1.0f;
      const T* h = static_cast<const T*>(a.h) + s * f_in;
      const float* g = a.grad_rows + r * f;
      const T* dout = static_cast<const T*>(a.dout) + t * hidden;
      float partial[kDotLanes] = {};
      for (int64_t c = 0; c < f; ++c) {
        const float x = to_float(h[c]), up = swiglu ? to_float(h[f + c]) : 0.0f;
        if (act || dprobs) {
          const T value = round_to<T>(activation_forward(a.activation, x, up));
          if (act) act[r * f + c] = value;
          if (dprobs) partial[c % kDotLanes] = add_product(partial[c % kDotLanes], to_float(value), g[c]);
        }
        if (dh) {
          const ActivationGrad<float> d = activation_backward_at(a.activation, product(p, g[c]), x, up);
          dh[r * f_in + c] = round_to<T>(d.dx);
          if (swiglu) dh[r * f_in + f + c] = round_to<T>(d.dup);
        }
      }
      if (dprobs) {
        float dot = fold_dot_lanes(partial);
        if (a.b_out) {
          const int64_t e = expert_of_row(a.bucket_start, a.num_experts, r);
          const T* bias = static_cast<const T*>(a.b_out) + e * hidden;
          float bias_partial[kDotLanes] = {};
          for (int64_t c = 0; c < hidden; ++c)
            bias_partial[c % kDotLanes] =
                add_product(bias_partial[c % kDotLanes], to_float(bias[c]), to_float(dout[c]));
          dot = dot + fold_dot_lanes(bias_partial);
        }
        dprobs[s] = round_to<P>(dot);
      }
      if (dy)
        for (int64_t c = 0; c < hidden; ++c) dy[r * hidden + c] = round_to<T>(product(p, to_float(dout[c])));
    }
  }

  ExpertLaunchRecord record_;
};

}  // namespace emulated
}  // namespace groupgemm
