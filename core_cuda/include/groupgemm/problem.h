// One local group's GEMM, D[m, n] (+)= A[m, k] @ B[k, n] (+ C), described as element
// offsets into the call's operands plus leading dimensions. Both backends build their
// per-group GEMMs from these functions: the CPU backend calls its library with them and
// the CUDA setup kernel writes them into CUTLASS's problem, pointer and ld arrays.
//
// Storage: D is row-major with ldd. A is row-major [m, k] (lda = row stride) or, when
// a_transposed, stored as [k, m] (lda = stride between its k rows); B likewise [k, n] or
// [n, k]. C is the bias row broadcast with ldc = 0, or D itself (accumulating, or a
// forward output pre-filled with its bias rows).
#pragma once

#include <cstdint>

#include "groupgemm/schedule.h"

namespace groupgemm {

struct GroupProblem {
  GroupAction action;
  int64_t m, n, k;
  bool a_transposed, b_transposed;
  int64_t a_offset, b_offset, c_offset, d_offset;  // in elements of each operand
  int64_t lda, ldb, ldc, ldd;
};

// Forward / dgrad: out[rows] = lhs[rows] @ rhs[local] (+ bias[local]).
// rhs[local] is [K, N], or [N, K] when transpose_rhs; bias[local] is a row of N, read as
// C with ldc = 0 unless c_is_output: then C is the output itself, whose rows already hold
// the bias (a float32 output of 16-bit inputs, which the setup fills with its bias rows).
GG_HD GroupProblem forward_problem(RowRange rows, int64_t local, int64_t k, int64_t n, bool transpose_rhs,
                                   bool c_is_output = false) {
  GroupProblem p{};
  p.action = forward_action(rows.rows(), k);
  p.m = rows.rows(), p.n = n, p.k = k;
  p.a_transposed = false, p.b_transposed = transpose_rhs;
  p.a_offset = rows.begin * k, p.lda = k;
  p.b_offset = local * k * n, p.ldb = transpose_rhs ? k : n;
  p.d_offset = rows.begin * n, p.ldd = n;
  p.c_offset = c_is_output ? p.d_offset : local * n;  // one bias row for every output row
  p.ldc = c_is_output ? n : 0;
  return p;
}

// Weight gradient: out[local] (+)= lhs[rows]^T @ grad[rows], contracting over the rows.
// lhs[rows] is [rows, K] row-major, i.e. the [K, rows] operand A stored transposed.
GG_HD GroupProblem wgrad_problem(RowRange rows, int64_t local, int64_t k, int64_t n, bool accumulate) {
  GroupProblem p{};
  p.action = reduction_action(rows.rows(), accumulate);
  p.m = k, p.n = n, p.k = rows.rows();
  p.a_transposed = true, p.b_transposed = false;
  p.a_offset = rows.begin * k, p.lda = k;
  p.b_offset = rows.begin * n, p.ldb = n;
  p.c_offset = p.d_offset = local * k * n;  // C is D: accumulate reads what it adds to
  p.ldc = p.ldd = n;
  return p;
}

}  // namespace groupgemm
