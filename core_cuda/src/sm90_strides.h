// How the sm_90a kernel (CUTLASS 3.x) reads the workspace's leading-dimension arrays.
// CUTLASS 3.x indexes A as (m, k), B as (n, k) and C / D as (m, n), each with a stride per
// mode, and for the pointer-array kernels exactly one mode's stride is a run-time int64:
// the workspace's ld for that operand is that stride, the other mode's is 1. Which mode
// that is follows from the operand's storage (problem.h); cuda/cutlass_sm90.cuh asserts
// the kernel's stride types agree, and the core tests run a GEMM through these strides.
#pragma once

#include <cstdint>

#include "gemm_call.h"

namespace groupgemm {

enum class Sm90Operand : int { a = 0, b = 1, c = 2, d = 3 };

// The mode (0 or 1) whose stride is the operand's ld in `layout`.
constexpr int sm90_ld_mode(GemmLayout layout, Sm90Operand op) {
  switch (op) {
    case Sm90Operand::a: return layout == GemmLayout::col_row ? 1 : 0;  // row-major [m, k]: m strides by lda
    case Sm90Operand::b: return layout == GemmLayout::row_col ? 0 : 1;  // [n, k] storage: n strides by ldb
    default: return 0;                                                  // row-major D (and C): m by ldd
  }
}

// The element offset of (i, j) in the operand's 3.x mode order, from its ld.
constexpr int64_t sm90_offset(GemmLayout layout, Sm90Operand op, int64_t ld, int64_t i, int64_t j) {
  return sm90_ld_mode(layout, op) == 0 ? i * ld + j : i + j * ld;
}

}  // namespace groupgemm
