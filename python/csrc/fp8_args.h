// The FP8 calls' arguments from their views (arg_view.h), for both bindings. float8
// operands are XLA float8 buffers, whose element type is their format (the `*_type`
// arguments are then nullopt), or DLPack uint8 arrays of their bytes with the format passed
// beside them; scales are float32 with the counts groupgemm/fp8_blocks.h gives.
#pragma once

#include <optional>

#include "arg_view.h"
#include "groupgemm/fp8.h"
#include "groupgemm/fp8_blocks.h"

namespace groupgemm {
namespace glue {

// x [R..., C] (rows: every index but the last) -> q (x's shape), scale.
inline QuantizeRowsArgs quantize_rows_args(const ArgView& x, const ArgView& q, const ArgView& scale,
                                           std::optional<Fp8Type> out_type, Fp8Scaling scaling,
                                           bool power_of_two) {
  QuantizeRowsArgs a;
  if (x.rank < 2) refuse(x, "must have rank 2 or more, got " + std::to_string(x.rank));
  a.cols = x.dims[x.rank - 1], a.rows = 1;
  for (int i = 0; i + 1 < x.rank; ++i) a.rows *= x.dims[i];
  a.in_dtype = float_dtype(x), a.out_type = fp8_operand(q, out_type), a.scaling = scaling;
  a.power_of_two = power_of_two;
  expect_rank(q, x.rank);
  for (int i = 0; i < x.rank; ++i) expect_dim(q, i, x.dims[i]);
  a.x = x.data, a.q = q.data, a.scale = fp8_scale(scale, row_scale_count(scaling, a.rows, a.cols));
  return a;
}

// x [B, R, C] -> q [B, R, C], scale per 128 x 128 block.
inline QuantizeBlocksArgs quantize_blocks_args(const ArgView& x, const ArgView& q, const ArgView& scale,
                                               std::optional<Fp8Type> out_type, bool power_of_two) {
  QuantizeBlocksArgs a;
  expect_rank(x, 3);
  a.batch = x.dims[0], a.rows = x.dims[1], a.cols = x.dims[2];
  a.in_dtype = float_dtype(x), a.out_type = fp8_operand(q, out_type), a.power_of_two = power_of_two;
  expect_shape(q, {a.batch, a.rows, a.cols});
  a.x = x.data, a.q = q.data, a.scale = fp8_scale(scale, block_scale_count(a.batch, a.rows, a.cols));
  return a;
}

// x [M, C] -> q [C, M] (channel-major), scale per (group or token block, channel).
inline QuantizeGroupedArgs quantize_grouped_args(const ArgView& x, const ArgView& group_sizes,
                                                 const ArgView& group_offset, const ArgView& q,
                                                 const ArgView& scale, int64_t num_groups,
                                                 std::optional<Fp8Type> out_type, Fp8Scaling scaling,
                                                 bool power_of_two) {
  QuantizeGroupedArgs a;
  expect_rank(x, 2), expect_rank(group_sizes, 1);
  if (num_groups < 0) throw ArgError("num_groups must be non-negative", false);
  a.m = x.dims[0], a.cols = x.dims[1], a.num_groups = num_groups;
  a.in_dtype = float_dtype(x), a.out_type = fp8_operand(q, out_type), a.scaling = scaling;
  a.power_of_two = power_of_two;
  expect_shape(q, {a.cols, a.m});
  a.x = x.data, a.q = q.data;
  a.scale = fp8_scale(scale, token_scale_rows(scaling, a.m, num_groups) * a.cols);
  a.group_sizes = index_array(group_sizes), a.group_offset = optional_offset(group_offset);
  return a;
}

// out [M, N] = scaled lhs [M, K] @ rhs[g]^T (rhs [G, N, K]) (+ bias [G, N] in out's dtype).
inline ScaledMatmulArgs scaled_matmul_args(const ArgView& lhs, const ArgView& rhs, const ArgView& lhs_scale,
                                           const ArgView& rhs_scale, const ArgView& group_sizes,
                                           const ArgView& group_offset, const ArgView& bias,
                                           const ArgView& out, std::optional<Fp8Type> lhs_type,
                                           std::optional<Fp8Type> rhs_type, Fp8Scaling scaling,
                                           bool group_ends) {
  ScaledMatmulArgs a;
  expect_rank(lhs, 2), expect_rank(rhs, 3), expect_rank(group_sizes, 1);
  a.m = lhs.dims[0], a.k = lhs.dims[1], a.num_groups = rhs.dims[0], a.n = rhs.dims[1];
  expect_dim(rhs, 2, a.k), expect_shape(out, {a.m, a.n});
  a.lhs_type = fp8_operand(lhs, lhs_type), a.rhs_type = fp8_operand(rhs, rhs_type), a.scaling = scaling;
  a.out_dtype = float_dtype(out);
  a.lhs = lhs.data, a.rhs = rhs.data, a.out = out.data;
  a.lhs_scale = fp8_scale(lhs_scale, row_scale_count(scaling, a.m, a.k));
  a.rhs_scale = fp8_scale(rhs_scale, weight_scale_count(scaling, a.num_groups, a.n, a.k));
  if (bias.given()) {
    expect_shape(bias, {a.num_groups, a.n});
    expect_dtype(bias, a.out_dtype, "out");
    a.bias = bias.data;
  }
  a.group_sizes = index_array(group_sizes, group_ends), a.group_offset = optional_offset(group_offset);
  return a;
}

// out [G, K, N] (+)= scaled lhs [K, M] @ rhs [N, M]^T over each group's tokens.
inline ScaledWgradArgs scaled_wgrad_args(const ArgView& lhs, const ArgView& rhs, const ArgView& lhs_scale,
                                         const ArgView& rhs_scale, const ArgView& group_sizes,
                                         const ArgView& group_offset, const ArgView& out,
                                         std::optional<Fp8Type> lhs_type, std::optional<Fp8Type> rhs_type,
                                         Fp8Scaling scaling, bool accumulate, bool group_ends) {
  ScaledWgradArgs a;
  expect_rank(lhs, 2), expect_rank(rhs, 2), expect_rank(out, 3), expect_rank(group_sizes, 1);
  a.k = lhs.dims[0], a.m = lhs.dims[1], a.n = rhs.dims[0], a.num_groups = out.dims[0];
  expect_dim(rhs, 1, a.m), expect_dim(out, 1, a.k), expect_dim(out, 2, a.n);
  a.lhs_type = fp8_operand(lhs, lhs_type), a.rhs_type = fp8_operand(rhs, rhs_type), a.scaling = scaling;
  a.out_dtype = float_dtype(out), a.accumulate = accumulate;
  a.lhs = lhs.data, a.rhs = rhs.data, a.out = out.data;
  const int64_t scale_rows = token_scale_rows(scaling, a.m, a.num_groups);
  a.lhs_scale = fp8_scale(lhs_scale, scale_rows * a.k);
  a.rhs_scale = fp8_scale(rhs_scale, scale_rows * a.n);
  a.group_sizes = index_array(group_sizes, group_ends), a.group_offset = optional_offset(group_offset);
  return a;
}

}  // namespace glue
}  // namespace groupgemm
