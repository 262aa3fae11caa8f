// A grouped_matmul backward as the three separate calls it is equal to, bit for bit: the
// input gradient (a grouped_matmul of grad with the transpose flipped), the weight
// gradient (a grouped_matmul_wgrad whose operands follow rhs's layout) and the bias
// gradient. The core validates a backward as these calls, the CPU backend runs them, and
// the CUDA call sequence runs their GEMMs from one setup.
#pragma once

#include "groupgemm/types.h"

namespace groupgemm {

// dlhs [M, K] = grad [M, N] @ rhs[g]^T.
inline MatmulArgs dgrad_part(const BackwardArgs& a) {
  MatmulArgs d;
  d.in_dtype = d.out_dtype = a.in_dtype;
  d.lhs = a.grad, d.rhs = a.rhs, d.out = a.dlhs;
  d.m = a.m, d.k = a.n, d.n = a.k, d.num_groups = a.num_groups;
  d.transpose_rhs = !a.transpose_rhs;
  d.group_sizes = a.group_sizes, d.group_offset = a.group_offset;
  return d;
}

// drhs[g] = lhs_g^T @ grad_g ([K, N]), or grad_g^T @ lhs_g ([N, K]) for a transposed rhs.
inline WgradArgs wgrad_part(const BackwardArgs& a) {
  WgradArgs w;
  w.in_dtype = a.in_dtype, w.out_dtype = a.drhs_dtype;
  w.lhs = a.transpose_rhs ? a.grad : a.lhs;
  w.grad = a.transpose_rhs ? a.lhs : a.grad;
  w.out = a.drhs, w.m = a.m;
  w.k = a.transpose_rhs ? a.n : a.k;
  w.n = a.transpose_rhs ? a.k : a.n;
  w.num_groups = a.num_groups, w.accumulate = a.accumulate;
  w.group_sizes = a.group_sizes, w.group_offset = a.group_offset;
  return w;
}

// dbias [G, N]: group g's rows of grad, summed.
inline BiasGradArgs bias_grad_part(const BackwardArgs& a) {
  BiasGradArgs b;
  b.in_dtype = a.in_dtype, b.out_dtype = a.dbias_dtype;
  b.grad = a.grad, b.out = a.dbias;
  b.m = a.m, b.n = a.n, b.num_groups = a.num_groups;
  b.group_sizes = a.group_sizes, b.group_offset = a.group_offset;
  return b;
}

}  // namespace groupgemm
