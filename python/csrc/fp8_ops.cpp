// The FP8 entry points (op_table.h, groupgemm/fp8.h). float8 operands are XLA float8
// buffers, whose element type is their format, or DLPack uint8 arrays of their bytes with
// the format given as an attribute beside them (lhs_type, rhs_type, out_type: Fp8Type's
// values); scales are float32 with the counts groupgemm/fp8_blocks.h gives.
#include "arg_view.h"
#include "groupgemm/fp8.h"
#include "groupgemm/fp8_blocks.h"
#include "op_table.h"

namespace groupgemm {
namespace {

using namespace glue;

Fp8Scaling scaling_of(const OpCall& call) { return *call.enumerated<Fp8Scaling>("scaling"); }

// x [R..., C] (rows: every index but the last; a weight's [G, N, K] unreshaped) -> q (x's
// shape), scale.
GROUPGEMM_OP(fp8_quantize_rows, "groupgemm_fp8_quantize_rows", "x", "q scale",
             "scaling power_of_two? out_type?",
             "x [R, C] -> q [R, C] float8, scale [R] (rowwise) or [R, ceil(C/128)].") {
  QuantizeRowsArgs a;
  const ArgView x = call.array("x"), q = call.array("q");
  if (x.rank < 2) refuse(x, "must have rank 2 or more, got " + std::to_string(x.rank));
  a.cols = x.dims[x.rank - 1], a.rows = 1;
  for (int i = 0; i + 1 < x.rank; ++i) a.rows *= x.dims[i];
  a.in_dtype = float_dtype(x), a.out_type = fp8_operand(q, call.enumerated<Fp8Type>("out_type"));
  a.scaling = scaling_of(call), a.power_of_two = call.flag("power_of_two");
  expect_rank(q, x.rank);
  for (int i = 0; i < x.rank; ++i) expect_dim(q, i, x.dims[i]);
  a.x = x.data, a.q = q.data,
  a.scale = fp8_scale(call.array("scale"), row_scale_count(a.scaling, a.rows, a.cols));
  return quantize_rows(a, call.context);
}

GROUPGEMM_OP(fp8_quantize_blocks, "groupgemm_fp8_quantize_blocks", "x", "q scale", "power_of_two? out_type?",
             "x [B, R, C] -> q [B, R, C] float8, scale [B, ceil(R/128), ceil(C/128)].") {
  QuantizeBlocksArgs a;
  const ArgView x = call.array("x"), q = call.array("q");
  expect_rank(x, 3);
  a.batch = x.dims[0], a.rows = x.dims[1], a.cols = x.dims[2];
  a.in_dtype = float_dtype(x), a.out_type = fp8_operand(q, call.enumerated<Fp8Type>("out_type"));
  a.power_of_two = call.flag("power_of_two");
  expect_shape(q, {a.batch, a.rows, a.cols});
  a.x = x.data, a.q = q.data,
  a.scale = fp8_scale(call.array("scale"), block_scale_count(a.batch, a.rows, a.cols));
  return quantize_blocks(a, call.context);
}

GROUPGEMM_OP(fp8_quantize_grouped, "groupgemm_fp8_quantize_grouped", "x group_sizes group_offset?",
             "q scale workspace?", "num_groups scaling power_of_two? out_type?",
             "x [M, C] -> q [C, M] float8 with scales per (group, channel) or per (token block, channel).") {
  QuantizeGroupedArgs a;
  const ArgView x = call.array("x"), q = call.array("q");
  expect_rank(x, 2);
  a.num_groups = call.integer("num_groups");
  if (a.num_groups < 0) throw ArgError("num_groups must be non-negative", false);
  a.m = x.dims[0], a.cols = x.dims[1];
  a.in_dtype = float_dtype(x), a.out_type = fp8_operand(q, call.enumerated<Fp8Type>("out_type"));
  a.scaling = scaling_of(call), a.power_of_two = call.flag("power_of_two");
  expect_shape(q, {a.cols, a.m});
  a.x = x.data, a.q = q.data;
  a.scale = fp8_scale(call.array("scale"), token_scale_rows(a.scaling, a.m, a.num_groups) * a.cols);
  set_groups(a, call, false);
  return quantize_grouped(a, call.context);
}

// The scaled GEMMs' float8 operands, groups and scaling.
template <typename Args>
void set_scaled(Args& a, const OpCall& call) {
  a.lhs_type = fp8_operand(call.array("lhs"), call.enumerated<Fp8Type>("lhs_type"));
  a.rhs_type = fp8_operand(call.array("rhs"), call.enumerated<Fp8Type>("rhs_type"));
  a.scaling = scaling_of(call);
  set_groups(a, call, call.flag("group_ends"));
}

// out [M, N] = scaled lhs [M, K] @ rhs[g]^T (rhs [G, N, K]) (+ bias [G, N] in out's dtype).
GROUPGEMM_OP(scaled_grouped_matmul, "groupgemm_scaled_matmul",
             "lhs rhs lhs_scale rhs_scale group_sizes group_offset? bias?", "out workspace?",
             "scaling lhs_type? rhs_type? group_ends?",
             "out[M, N] = scaled lhs[M, K] @ rhs[g]^T ([G, N, K]) per group (+ bias[g]); padding rows are 0. "
             "group_ends: group_sizes holds cumulative group ends.") {
  ScaledMatmulArgs a;
  const ArgView lhs = call.array("lhs"), rhs = call.array("rhs"), out = call.array("out"),
                bias = call.array("bias");
  expect_rank(lhs, 2), expect_rank(rhs, 3);
  a.m = lhs.dims[0], a.k = lhs.dims[1], a.num_groups = rhs.dims[0], a.n = rhs.dims[1];
  expect_dim(rhs, 2, a.k), expect_shape(out, {a.m, a.n});
  set_scaled(a, call);
  a.out_dtype = float_dtype(out);
  a.lhs = lhs.data, a.rhs = rhs.data, a.out = out.data;
  a.lhs_scale = fp8_scale(call.array("lhs_scale"), row_scale_count(a.scaling, a.m, a.k));
  a.rhs_scale = fp8_scale(call.array("rhs_scale"), weight_scale_count(a.scaling, a.num_groups, a.n, a.k));
  if (bias.given()) {
    expect_shape(bias, {a.num_groups, a.n});
    expect_dtype(bias, a.out_dtype, "out");
    a.bias = bias.data;
  }
  return scaled_grouped_matmul(a, call.context);
}

// out [G, K, N] (+)= scaled lhs [K, M] @ rhs [N, M]^T over each group's tokens; with
// accumulate, accumulate_into is out itself, as for grouped_matmul_wgrad.
GROUPGEMM_OP(
    scaled_grouped_matmul_wgrad, "groupgemm_scaled_wgrad",
    "lhs rhs lhs_scale rhs_scale group_sizes group_offset? accumulate_into?", "out workspace?",
    "scaling lhs_type? rhs_type? accumulate? group_ends?",
    "out[g] (+)= scaled lhs[:, rows_g] @ rhs[:, rows_g]^T (lhs [K, M], rhs [N, M]); empty groups give 0. "
    "group_ends: group_sizes holds cumulative group ends.") {
  ScaledWgradArgs a;
  const ArgView lhs = call.array("lhs"), rhs = call.array("rhs"), out = call.array("out");
  expect_rank(lhs, 2), expect_rank(rhs, 2), expect_rank(out, 3);
  a.k = lhs.dims[0], a.m = lhs.dims[1], a.n = rhs.dims[0], a.num_groups = out.dims[0];
  expect_dim(rhs, 1, a.m), expect_dim(out, 1, a.k), expect_dim(out, 2, a.n);
  set_scaled(a, call);
  a.out_dtype = float_dtype(out), a.accumulate = call.flag("accumulate");
  expect_accumulator(call.array("accumulate_into"), out, a.accumulate);
  a.lhs = lhs.data, a.rhs = rhs.data, a.out = out.data;
  const int64_t scale_rows = token_scale_rows(a.scaling, a.m, a.num_groups);
  a.lhs_scale = fp8_scale(call.array("lhs_scale"), scale_rows * a.k);
  a.rhs_scale = fp8_scale(call.array("rhs_scale"), scale_rows * a.n);
  return scaled_grouped_matmul_wgrad(a, call.context);
}

}  // namespace
}  // namespace groupgemm
