// The grouped GEMMs' entry points (op_table.h): each array checked against the sizes handed
// to the core.
#include "arg_view.h"
#include "groupgemm/groupgemm.h"
#include "op_table.h"

namespace groupgemm {
namespace {

using namespace glue;

// lhs [M, K] and rhs [G, K, N] ([G, N, K] with transpose_rhs) of one dtype.
template <typename Args>
void set_operands(Args& a, const ArgView& lhs, const ArgView& rhs, bool transpose_rhs) {
  expect_rank(lhs, 2), expect_rank(rhs, 3);
  a.m = lhs.dims[0], a.k = lhs.dims[1], a.num_groups = rhs.dims[0], a.n = rhs.dims[transpose_rhs ? 1 : 2];
  expect_dim(rhs, transpose_rhs ? 2 : 1, a.k);
  a.in_dtype = float_dtype(lhs);
  expect_dtype(rhs, a.in_dtype, "lhs");
  a.lhs = lhs.data, a.rhs = rhs.data, a.transpose_rhs = transpose_rhs;
}

GROUPGEMM_OP(grouped_matmul, "groupgemm_matmul", "lhs rhs group_sizes group_offset? bias?", "out workspace?",
             "transpose_rhs? group_ends?",
             "out[M,N] = lhs[M,K] @ rhs[g] (+ bias[g]) per group; padding rows are written as 0. group_ends: "
             "group_sizes holds cumulative group ends.") {
  MatmulArgs a;
  const ArgView rhs = call.array("rhs"), out = call.array("out"), bias = call.array("bias");
  set_operands(a, call.array("lhs"), rhs, call.flag("transpose_rhs"));
  expect_shape(out, {a.m, a.n});
  a.out_dtype = float_dtype(out), a.out = out.data;
  if (bias.given()) {
    expect_shape(bias, {a.num_groups, a.n});
    expect_dtype(bias, a.in_dtype, "lhs");
    a.bias = bias.data;
  }
  set_groups(a, call, call.flag("group_ends"));
  return grouped_matmul(a, call.context);
}

// With accumulate, out holds the accumulator and is added into: accumulate_into is out itself
// (expect_accumulator).
GROUPGEMM_OP(grouped_matmul_wgrad, "groupgemm_wgrad", "lhs grad group_sizes group_offset? accumulate_into?",
             "out workspace?", "accumulate? group_ends?",
             "out[g] = lhs_g^T @ grad_g (or += with accumulate); empty groups give 0 (or stay untouched).") {
  WgradArgs a;
  const ArgView lhs = call.array("lhs"), grad = call.array("grad"), out = call.array("out");
  expect_rank(lhs, 2), expect_rank(grad, 2), expect_rank(out, 3);
  a.m = lhs.dims[0], a.k = lhs.dims[1], a.n = grad.dims[1], a.num_groups = out.dims[0];
  expect_dim(grad, 0, a.m), expect_dim(out, 1, a.k), expect_dim(out, 2, a.n);
  a.in_dtype = float_dtype(lhs), a.out_dtype = float_dtype(out);
  expect_dtype(grad, a.in_dtype, "lhs");
  a.lhs = lhs.data, a.grad = grad.data, a.out = out.data, a.accumulate = call.flag("accumulate");
  expect_accumulator(call.array("accumulate_into"), out, a.accumulate);
  set_groups(a, call, call.flag("group_ends"));
  return grouped_matmul_wgrad(a, call.context);
}

GROUPGEMM_OP(grouped_bias_grad, "groupgemm_bias_grad", "grad group_sizes group_offset?", "out workspace?",
             "group_ends?", "out[g] = sum of grad rows of group g; empty groups give 0.") {
  BiasGradArgs a;
  const ArgView grad = call.array("grad"), out = call.array("out");
  expect_rank(grad, 2), expect_rank(out, 2);
  a.m = grad.dims[0], a.n = grad.dims[1], a.num_groups = out.dims[0];
  expect_dim(out, 1, a.n);
  a.in_dtype = float_dtype(grad), a.out_dtype = float_dtype(out);
  a.grad = grad.data, a.out = out.data;
  set_groups(a, call, call.flag("group_ends"));
  return grouped_bias_grad(a, call.context);
}

GROUPGEMM_OP(
    grouped_matmul_backward, "groupgemm_matmul_backward", "lhs rhs grad group_sizes group_offset?",
    "dlhs? drhs? dbias? workspace?", "transpose_rhs? accumulate? group_ends?",
    "The gradients of grouped_matmul from one setup: dlhs = grad @ rhs[g]^T, drhs[g] (+)= the weight "
    "gradient in rhs's layout, dbias[g] = sum of group g's grad rows; each written when given.") {
  BackwardArgs a;
  const ArgView rhs = call.array("rhs"), grad = call.array("grad");
  set_operands(a, call.array("lhs"), rhs, call.flag("transpose_rhs"));
  expect_shape(grad, {a.m, a.n});
  expect_dtype(grad, a.in_dtype, "lhs");
  a.grad = grad.data, a.accumulate = call.flag("accumulate");
  if (const ArgView dlhs = call.array("dlhs"); dlhs.given()) {
    expect_shape(dlhs, {a.m, a.k});
    expect_dtype(dlhs, a.in_dtype, "lhs");
    a.dlhs = dlhs.data;
  }
  if (const ArgView drhs = call.array("drhs"); drhs.given()) {
    expect_shape(drhs, {rhs.dims[0], rhs.dims[1], rhs.dims[2]});
    a.drhs_dtype = float_dtype(drhs), a.drhs = drhs.data;
  }
  if (const ArgView dbias = call.array("dbias"); dbias.given()) {
    expect_shape(dbias, {a.num_groups, a.n});
    a.dbias_dtype = float_dtype(dbias), a.dbias = dbias.data;
  }
  set_groups(a, call, call.flag("group_ends"));
  return grouped_matmul_backward(a, call.context);
}

}  // namespace
}  // namespace groupgemm
