// One grouped GEMM of the CUDA call sequence, as the GEMM kernels see it: its operand
// layout, what it adds to A B, and the workspace's GEMM set it reads. Its own header so
// that the GEMM kernels (the CUTLASS instantiations, which take minutes to build) do not
// depend on the call sequence and the setup's rules.
#pragma once

#include <cstdint>

#include "groupgemm/types.h"

namespace groupgemm {

// Operand storage of the three GEMM kinds, all with a row-major D:
//   row_row: forward / dgrad, A = lhs [m, k], B = rhs[g] [k, n]
//   row_col: forward / dgrad with rhs[g] stored [n, k]
//   col_row: wgrad, A = lhs_g^T (lhs_g is [rows, k]), B = grad_g [rows, n]
enum class GemmLayout : int { row_row = 0, row_col = 1, col_row = 2 };

// What a GEMM adds to A B: nothing (beta = 0), its group's bias row broadcast over the
// rows (ldc = 0), or what the output already holds (C = D: accumulating, or bias rows the
// setup wrote). The last two run with beta = 1.
enum class GemmC : int { none = 0, bias_row = 1, output = 2 };

// One grouped GEMM over the problems, pointers and leading dimensions of GEMM set `set`.
struct GroupedGemmCall {
  DType in_dtype;
  DType out_dtype;  // D, and C unless c == none
  GemmLayout layout;
  int64_t num_groups;
  GemmC c;
  int64_t max_m;  // bound on any group's m
  int64_t n;      // every group's n
  int set;        // the workspace's GEMM set
  const void* workspace;
};

}  // namespace groupgemm
