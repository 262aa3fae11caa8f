// The CPU backend's scaled grouped GEMMs: the exact reference of the FP8 path.
//
// Every product of two float8 values is exact in float32 (at most 4 + 4 significant
// bits). Each output element sums its products block by block, 128 contraction indices
// each, in ascending order in float32; a block's sum is multiplied by the block's scale
// product lhs_scale * rhs_scale and added to the element's float32 accumulator with one
// fused multiply-add, blocks in ascending order. One thread computes each element from
// start to end, so the bits do not depend on the thread count. The loops run over the
// output columns innermost, which keeps each element's order and lets the compiler use
// vector instructions across columns.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "fp8_backends.h"
#include "fp8_groups.h"
#include "groupgemm/fp8_math.h"

namespace groupgemm {
namespace cpu {
namespace {

// The 256 float8 bit patterns of a format, decoded.
std::array<float, 256> decode_table(Fp8Type t) {
  std::array<float, 256> table{};
  for (int b = 0; b < 256; ++b) table[b] = fp8_to_float(static_cast<uint8_t>(b), t);
  return table;
}

// Calls fn(Out{}) with the output's storage type (bfloat16 or float32).
template <typename Fn>
Status with_output(DType t, Fn&& fn) {
  if (t == DType::bf16) return fn(bf16_t{});
  return fn(float{});
}

// partial[j] += a * row[j] for j < n: one step of every column's ascending-order sum.
inline void add_scaled_row(float* partial, float a, const float* row, int64_t n) {
  for (int64_t j = 0; j < n; ++j) partial[j] += a * row[j];
}

// acc[j] = fma(partial[j], lhs_scale * rhs_scale[j], acc[j]).
inline void accumulate_block(float* acc, const float* partial, float lhs_scale, const float* rhs_scale,
                             int64_t n) {
  for (int64_t j = 0; j < n; ++j) acc[j] = std::fma(partial[j], lhs_scale * rhs_scale[j], acc[j]);
}

void zero_rows(void* out, DType t, RowRange rows, int64_t n) {
  if (rows.rows() > 0)
    std::memset(static_cast<char*>(out) + rows.begin * n * dtype_size(t), 0, rows.rows() * n * dtype_size(t));
}

}  // namespace

Status scaled_grouped_matmul(const ScaledMatmulArgs& a) {
  const LocalGroups groups = local_groups(a.group_sizes, a.group_offset, a.num_groups, a.m);
  zero_rows(a.out, a.out_dtype, {0, groups.owned.begin}, a.n);
  zero_rows(a.out, a.out_dtype, {groups.owned.end, a.m}, a.n);
  if (a.n == 0) return Status::Ok();
  const auto lhs_value = decode_table(a.lhs_type), rhs_value = decode_table(a.rhs_type);
  const auto* lhs = static_cast<const uint8_t*>(a.lhs);
  const auto* rhs = static_cast<const uint8_t*>(a.rhs);
  const int64_t k = a.k, n = a.n, kb_count = fp8_blocks(k);
  return with_output(a.out_dtype, [&](auto out_tag) {
    using Out = decltype(out_tag);
    Out* out = static_cast<Out*>(a.out);
    const Out* bias = static_cast<const Out*>(a.bias);
    std::vector<float> rhs_t(k * n), rhs_scale(kb_count * n);
    for (int64_t g = 0; g < a.num_groups; ++g) {
      const RowRange rows = groups.rows[g];
      if (rows.rows() == 0) continue;
      for (int64_t j = 0; j < n; ++j)  // rhs[g] [N, K] decoded and transposed to [K, N]
        for (int64_t kk = 0; kk < k; ++kk) rhs_t[kk * n + j] = rhs_value[rhs[(g * n + j) * k + kk]];
      for (int64_t kb = 0; kb < kb_count; ++kb)
        for (int64_t j = 0; j < n; ++j)
          rhs_scale[kb * n + j] = a.rhs_scale[rhs_scale_index(a.scaling, g, j, n, kb, kb_count)];
#pragma omp parallel
      {
        std::vector<float> partial(n), acc(n);
#pragma omp for schedule(static)
        for (int64_t r = rows.begin; r < rows.end; ++r) {
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t kb = 0; kb < kb_count; ++kb) {
            std::fill(partial.begin(), partial.end(), 0.0f);
            for (int64_t kk = kb * kFp8Block; kk < std::min(k, (kb + 1) * kFp8Block); ++kk)
              add_scaled_row(partial.data(), lhs_value[lhs[r * k + kk]], &rhs_t[kk * n], n);
            accumulate_block(acc.data(), partial.data(),
                             a.lhs_scale[lhs_scale_index(a.scaling, r, kb, kb_count)], &rhs_scale[kb * n], n);
          }
          for (int64_t j = 0; j < n; ++j)  // no +0 without bias: it would turn -0 into +0
            out[r * n + j] = narrow<Out>(bias ? acc[j] + widen(bias[g * n + j]) : acc[j]);
        }
      }
    }
    return Status::Ok();
  });
}

Status scaled_grouped_matmul_wgrad(const ScaledWgradArgs& a) {
  const LocalGroups groups = local_groups(a.group_sizes, a.group_offset, a.num_groups, a.m);
  const int64_t m = a.m, k = a.k, n = a.n, block = k * n;
  if (block == 0) return Status::Ok();
  const auto lhs_value = decode_table(a.lhs_type), rhs_value = decode_table(a.rhs_type);
  const auto* lhs = static_cast<const uint8_t*>(a.lhs);
  const auto* rhs = static_cast<const uint8_t*>(a.rhs);
  return with_output(a.out_dtype, [&](auto out_tag) {
    using Out = decltype(out_tag);
    Out* out = static_cast<Out*>(a.out);
    std::vector<float> rhs_t;
    for (int64_t g = 0; g < a.num_groups; ++g) {
      const RowRange rows = groups.rows[g];
      if (rows.rows() == 0) {
        if (!a.accumulate) std::memset(out + g * block, 0, block * sizeof(Out));
        continue;
      }
      rhs_t.resize(rows.rows() * n);  // rhs[:, rows] [N, T] decoded and transposed to [T, N]
      for (int64_t j = 0; j < n; ++j)
        for (int64_t t = rows.begin; t < rows.end; ++t)
          rhs_t[(t - rows.begin) * n + j] = rhs_value[rhs[j * m + t]];
#pragma omp parallel
      {
        std::vector<float> partial(n), acc(n);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < k; ++i) {
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t begin = rows.begin; begin < rows.end; begin += kFp8Block) {
            const int64_t end = std::min(rows.end, begin + kFp8Block);
            const int64_t scale_row = token_block_of_row(a.scaling, g, groups.first_block[g], rows, begin);
            std::fill(partial.begin(), partial.end(), 0.0f);
            for (int64_t t = begin; t < end; ++t)
              add_scaled_row(partial.data(), lhs_value[lhs[i * m + t]], &rhs_t[(t - rows.begin) * n], n);
            accumulate_block(acc.data(), partial.data(), a.lhs_scale[scale_row * k + i],
                             &a.rhs_scale[scale_row * n], n);
          }
          Out* row = out + g * block + i * n;
          for (int64_t j = 0; j < n; ++j) {
            if constexpr (std::is_same_v<Out, float>) {
              row[j] = a.accumulate ? row[j] + acc[j] : acc[j];
            } else {
              row[j] = narrow<Out>(acc[j]);
            }
          }
        }
      }
    }
    return Status::Ok();
  });
}

}  // namespace cpu
}  // namespace groupgemm
