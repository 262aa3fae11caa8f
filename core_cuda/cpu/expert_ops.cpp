// The CPU backend's expert-layer ops: permute and unpermute's backward run
// groupgemm/permute.h's sorting steps (one chunk, sequential scans); unpermute and its
// backward, the activations and the router run the same per-element (per-row, per-token)
// functions as the CUDA kernels. Threads split rows
// only, and every value is computed by one thread in a fixed order, so the bits do not
// depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "backends.h"
#include "convert.h"
#include "groupgemm/activation.h"
#include "groupgemm/permute.h"
#include "groupgemm/router.h"
#include "sigmoid_rows.h"
#include "values.h"

namespace groupgemm {
namespace cpu {
Status permute_in_chunks(const PermuteArgs& a, int64_t chunks) {
  std::vector<int32_t> counts(count_entries(a.num_experts, chunks)), bucket_start(a.num_experts + 1);
  const int64_t kept = permute_rows_on_host(a, chunks, counts.data(), bucket_start.data());
  const int64_t slots = a.num_tokens * a.top_k;
  const int64_t row_bytes = a.hidden * dtype_size(a.dtype);
  if (row_bytes == 0) return Status::Ok();
  const char* tokens = static_cast<const char*>(a.tokens);
  char* permuted = static_cast<char*>(a.permuted);
#pragma omp parallel for schedule(static) if (parallel_rows(slots, a.hidden))
  for (int64_t i = 0; i < slots; ++i) {
    const PermuteFill fill = permute_fill(a.row_map, i, a.top_k, kept);
    if (fill.copy_row >= 0)
      std::memcpy(permuted + fill.copy_row * row_bytes, tokens + fill.token * row_bytes, row_bytes);
    if (fill.zero_row) std::memset(permuted + i * row_bytes, 0, row_bytes);
  }
  return Status::Ok();
}

Status permute(const PermuteArgs& a) { return permute_in_chunks(a, 1); }

Status unpermute(const UnpermuteArgs& a) {
  return visit_values_and_probs(a.dtype, a.probs ? a.probs_dtype : a.dtype, [&](auto v_tag, auto p_tag) {
    using T = decltype(v_tag);
    using P = decltype(p_tag);
    using A = Acc<T>;
    const T* permuted = static_cast<const T*>(a.permuted);
    const P* probs = static_cast<const P*>(a.probs);
    T* out = static_cast<T*>(a.out);
#pragma omp parallel if (parallel_rows(a.num_tokens, a.hidden * a.top_k))
    {
      // unpermute_sum's terms a whole row at a time: the same sums in the same order, in a
      // loop over the row's columns the compiler vectorizes.
      std::vector<A> sum(a.hidden);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < a.num_tokens; ++t) {
        std::fill(sum.begin(), sum.end(), A(0));
        for (int64_t j = 0; j < a.top_k; ++j) {
          const int64_t row = a.row_map[t * a.top_k + j];
          if (!maps_to_row(row, a.num_rows)) continue;
          const A p = probs ? load<A>(probs, t * a.top_k + j) : A(1);
          const T* value = permuted + row * a.hidden;
          for (int64_t h = 0; h < a.hidden; ++h) sum[h] = add_product(sum[h], p, load<A>(value, h));
        }
        T* out_t = out + t * a.hidden;
        for (int64_t h = 0; h < a.hidden; ++h) out_t[h] = store<T>(sum[h]);
      }
    }
    return Status::Ok();
  });
}

Status unpermute_backward_in_chunks(const UnpermuteBackwardArgs& a, int64_t chunks) {
  return visit_values_and_probs(
      a.dtype, a.probs || a.dprobs ? a.probs_dtype : a.dtype, [&](auto v_tag, auto p_tag) {
        using T = decltype(v_tag);
        using P = decltype(p_tag);
        using A = Acc<T>;
        const int64_t slots = a.num_tokens * a.top_k;
        const T* dout = static_cast<const T*>(a.dout);
        const T* permuted = static_cast<const T*>(a.permuted);
        const P* probs = static_cast<const P*>(a.probs);
        if (a.dpermuted && a.num_rows * a.hidden > 0) {
          std::vector<int32_t> counts(kRowDigitBuckets * chunks), bucket_start(kRowDigitBuckets),
              order(2 * slots);
          const int32_t* sorted =
              sort_slots_by_row_on_host(a.row_map, slots, a.num_rows, chunks, counts.data(),
                                        bucket_start.data(), order.data(), order.data() + slots);
          T* dpermuted = static_cast<T*>(a.dpermuted);
#pragma omp parallel if (parallel_rows(a.num_rows, a.hidden))
          {
            std::vector<A> sum(a.hidden);      // row_gradient's sums, a whole row at a time
            int64_t next = -1, last_row = -1;  // where the slots of row last_row + 1 begin
#pragma omp for schedule(static)
            for (int64_t r = 0; r < a.num_rows; ++r) {
              if (r != last_row + 1 || next < 0)
                next = first_key_at_least(a.row_map, sorted, slots, a.num_rows, r);
              const RowRange row = row_slots_from(a.row_map, sorted, slots, a.num_rows, r, next);
              next = row.end, last_row = r;
              for (int64_t i = row.begin; i < row.end; ++i) {
                const int64_t s = sorted[i];
                const A p = probs ? load<A>(probs, s) : A(1);
                const T* grad = dout + s / a.top_k * a.hidden;
                const bool first = i == row.begin;
                for (int64_t h = 0; h < a.hidden; ++h)
                  sum[h] = add_row_term<A>(sum[h], first, p, load<A>(grad, h));
              }
              T* out = dpermuted + r * a.hidden;
              for (int64_t h = 0; h < a.hidden; ++h) out[h] = row.begin == row.end ? T{} : store<T>(sum[h]);
            }
          }
        }
        if (!a.dprobs) return Status::Ok();
        P* dprobs = static_cast<P*>(a.dprobs);
#pragma omp parallel for schedule(static) if (parallel_rows(slots, a.hidden))
        for (int64_t slot = 0; slot < slots; ++slot) {
          const int64_t t = slot / a.top_k, row = a.row_map[slot];
          A dot = 0;
          if (maps_to_row(row, a.num_rows)) {
            A partial[kDotLanes];
            auto x = [&](int64_t h) { return load<A>(permuted, row * a.hidden + h); };
            auto y = [&](int64_t h) { return load<A>(dout, t * a.hidden + h); };
            for (int lane = 0; lane < kDotLanes; ++lane)
              partial[lane] = dot_lane_partial<A>(lane, a.hidden, x, y);
            dot = fold_dot_lanes(partial);
          }
          dprobs[slot] = store<P>(dot);
        }
        return Status::Ok();
      });
}

Status unpermute_backward(const UnpermuteBackwardArgs& a) { return unpermute_backward_in_chunks(a, 1); }

Status activation(const ActivationArgs& a) {
  return visit_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    const int64_t f_in = a.in_features, f_out = activation_out_features(a.kind, f_in);
    const T* h = static_cast<const T*>(a.h);
    T* out = static_cast<T*>(a.out);
#pragma omp parallel for schedule(static) if (parallel_rows(a.rows, f_in))
    for (int64_t m = 0; m < a.rows; ++m) {
      const T* x = h + m * f_in;
      T* y = out + m * f_out;
      const bool sigmoid_based = for_sigmoid_chunks(a.kind, x, f_out, [&](auto kind_constant, int64_t c0, int64_t n,
                                                                           const A* up, const A* sig) {
        forward_chunk(kind_constant, x, c0, n, up, sig, y);
      });
      if (!sigmoid_based)
        for (int64_t f = 0; f < f_out; ++f) y[f] = store<T>(activation_forward(a.kind, load<A>(x, f), A(0)));
    }
    return Status::Ok();
  });
}

Status activation_backward(const ActivationBackwardArgs& a) {
  return visit_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    const int64_t f_in = a.in_features, f_out = activation_out_features(a.kind, f_in);
    const T* dout = static_cast<const T*>(a.dout);
    const T* h = static_cast<const T*>(a.h);
    T* dh = static_cast<T*>(a.dh);
#pragma omp parallel for schedule(static) if (parallel_rows(a.rows, f_in))
    for (int64_t m = 0; m < a.rows; ++m) {
      const T* x = h + m * f_in;
      const T* dy = dout + m * f_out;
      T* dx = dh + m * f_in;
      const bool sigmoid_based = for_sigmoid_chunks(a.kind, x, f_out, [&](auto kind_constant, int64_t c0, int64_t n,
                                                                           const A* up, const A* sig) {
        backward_chunk(kind_constant, x, f_out, c0, n, up, sig, [&](int64_t i) { return load<A>(dy, c0 + i); }, dx);
      });
      if (!sigmoid_based)
        for (int64_t f = 0; f < f_out; ++f)
          dx[f] = store<T>(activation_backward_at(a.kind, load<A>(dy, f), load<A>(x, f), A(0)).dx);
    }
    return Status::Ok();
  });
}

Status softmax_topk(const SoftmaxTopkArgs& a) {
  return visit_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    const T* logits = static_cast<const T*>(a.logits);
    A* probs = static_cast<A*>(a.probs);
#pragma omp parallel for schedule(static) if (parallel_rows(a.num_tokens, a.num_experts * a.top_k))
    for (int64_t t = 0; t < a.num_tokens; ++t) {
      const T* row = logits + t * a.num_experts;
      softmax_topk_row<A>([&](int64_t e) { return load<A>(row, e); }, a.num_experts, a.top_k, a.renormalize,
                          a.expert_indices + t * a.top_k, probs + t * a.top_k);
    }
    return Status::Ok();
  });
}

Status softmax_topk_backward(const SoftmaxTopkBackwardArgs& a) {
  return visit_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    const T* logits = static_cast<const T*>(a.logits);
    const A* dprobs = static_cast<const A*>(a.dprobs);
    T* dlogits = static_cast<T*>(a.dlogits);
#pragma omp parallel for schedule(static) if (parallel_rows(a.num_tokens, a.num_experts * a.top_k))
    for (int64_t t = 0; t < a.num_tokens; ++t) {
      const T* row = logits + t * a.num_experts;
      T* drow = dlogits + t * a.num_experts;
      softmax_topk_backward_row<A>([&](int64_t e) { return load<A>(row, e); }, a.num_experts, a.top_k,
                                   a.renormalize, a.expert_indices + t * a.top_k,
                                   [&](int64_t j) { return dprobs[t * a.top_k + j]; },
                                   [&](int64_t e, A v) { drow[e] = store<T>(v); });
    }
    return Status::Ok();
  });
}

Status softmax_topk_tangent(const SoftmaxTopkTangentArgs& a) {
  return visit_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = Acc<T>;
    const T* logits = static_cast<const T*>(a.logits);
    const T* tlogits = static_cast<const T*>(a.tlogits);
    A* tprobs = static_cast<A*>(a.tprobs);
#pragma omp parallel for schedule(static) if (parallel_rows(a.num_tokens, a.num_experts * a.top_k))
    for (int64_t t = 0; t < a.num_tokens; ++t) {
      const T* row = logits + t * a.num_experts;
      const T* trow = tlogits + t * a.num_experts;
      softmax_topk_tangent_row<A>([&](int64_t e) { return load<A>(row, e); }, a.num_experts, a.top_k,
                                  a.renormalize, a.expert_indices + t * a.top_k,
                                  [&](int64_t e) { return load<A>(trow, e); }, tprobs + t * a.top_k);
    }
    return Status::Ok();
  });
}

}  // namespace cpu
}  // namespace groupgemm
