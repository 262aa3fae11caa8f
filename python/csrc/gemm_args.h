// The grouped GEMMs' arguments from their views (arg_view.h), for both bindings: the
// extents each buffer must have for the sizes handed to the core. An optional argument
// that was not given is a view with given() false.
#pragma once

#include "arg_view.h"

namespace groupgemm {
namespace glue {

// Group sizes (or, with group_ends, cumulative group ends) and the optional group_offset.
template <typename Args>
void set_groups(Args& a, const ArgView& group_sizes, const ArgView& group_offset, bool group_ends) {
  expect_rank(group_sizes, 1);
  a.group_sizes = index_array(group_sizes, group_ends);
  a.group_offset = optional_offset(group_offset);
}

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

// out [M, N] = lhs @ rhs[g] (+ bias [G, N]).
inline MatmulArgs matmul_args(const ArgView& lhs, const ArgView& rhs, const ArgView& group_sizes,
                              const ArgView& group_offset, const ArgView& bias, const ArgView& out,
                              bool transpose_rhs, bool group_ends) {
  MatmulArgs a;
  set_operands(a, lhs, rhs, transpose_rhs);
  expect_shape(out, {a.m, a.n});
  a.out_dtype = float_dtype(out), a.out = out.data;
  if (bias.given()) {
    expect_shape(bias, {a.num_groups, a.n});
    expect_dtype(bias, a.in_dtype, "lhs");
    a.bias = bias.data;
  }
  set_groups(a, group_sizes, group_offset, group_ends);
  return a;
}

// out [G, K, N] = lhs_g^T @ grad_g, lhs [M, K], grad [M, N].
inline WgradArgs wgrad_args(const ArgView& lhs, const ArgView& grad, const ArgView& group_sizes,
                            const ArgView& group_offset, const ArgView& out, bool accumulate,
                            bool group_ends) {
  WgradArgs a;
  expect_rank(lhs, 2), expect_rank(grad, 2), expect_rank(out, 3);
  a.m = lhs.dims[0], a.k = lhs.dims[1], a.n = grad.dims[1], a.num_groups = out.dims[0];
  expect_dim(grad, 0, a.m), expect_dim(out, 1, a.k), expect_dim(out, 2, a.n);
  a.in_dtype = float_dtype(lhs), a.out_dtype = float_dtype(out);
  expect_dtype(grad, a.in_dtype, "lhs");
  a.lhs = lhs.data, a.grad = grad.data, a.out = out.data, a.accumulate = accumulate;
  set_groups(a, group_sizes, group_offset, group_ends);
  return a;
}

// out [G, N] = the sum of each group's grad [M, N] rows.
inline BiasGradArgs bias_grad_args(const ArgView& grad, const ArgView& group_sizes,
                                   const ArgView& group_offset, const ArgView& out, bool group_ends) {
  BiasGradArgs a;
  expect_rank(grad, 2), expect_rank(out, 2);
  a.m = grad.dims[0], a.n = grad.dims[1], a.num_groups = out.dims[0];
  expect_dim(out, 1, a.n);
  a.in_dtype = float_dtype(grad), a.out_dtype = float_dtype(out);
  a.grad = grad.data, a.out = out.data;
  set_groups(a, group_sizes, group_offset, group_ends);
  return a;
}

// The matmul's gradients from one call: each of dlhs [M, K], drhs (rhs's shape) and
// dbias [G, N] is written when given.
inline BackwardArgs matmul_backward_args(const ArgView& lhs, const ArgView& rhs, const ArgView& grad,
                                         const ArgView& group_sizes, const ArgView& group_offset,
                                         const ArgView& dlhs, const ArgView& drhs, const ArgView& dbias,
                                         bool transpose_rhs, bool accumulate, bool group_ends) {
  BackwardArgs a;
  set_operands(a, lhs, rhs, transpose_rhs);
  expect_shape(grad, {a.m, a.n});
  expect_dtype(grad, a.in_dtype, "lhs");
  a.grad = grad.data, a.accumulate = accumulate;
  if (dlhs.given()) {
    expect_shape(dlhs, {a.m, a.k});
    expect_dtype(dlhs, a.in_dtype, "lhs");
    a.dlhs = dlhs.data;
  }
  if (drhs.given()) {
    expect_shape(drhs, {rhs.dims[0], rhs.dims[1], rhs.dims[2]});
    a.drhs_dtype = float_dtype(drhs), a.drhs = drhs.data;
  }
  if (dbias.given()) {
    expect_shape(dbias, {a.num_groups, a.n});
    a.dbias_dtype = float_dtype(dbias), a.dbias = dbias.data;
  }
  set_groups(a, group_sizes, group_offset, group_ends);
  return a;
}

}  // namespace glue
}  // namespace groupgemm
