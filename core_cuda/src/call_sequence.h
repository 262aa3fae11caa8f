// The CUDA backend's call sequence, written once: which steps each entry point runs, in
// which order, its early exits, and the two choices between steps (bias in the GEMM
// epilogue or added afterwards; tensor-core or unaligned grouped GEMM). cuda/backend.cu
// runs it with a launcher that enqueues the CUDA kernels; the core tests run it with a
// launcher that executes each step on the host, so the sequence the GPU runs is tested
// without one. Plain C++: no CUDA header.
//
// A launcher provides these members, each returning a Status (`workspace` is the call's,
// already written by setup() when a later step reads it):
//   start()                   once, after the early exits and before the first step
//                             (CUDA: makes the operands' device current)
//   setup(const SetupArgs&)   device group sizes -> workspace (setup.h)
//   fill_rows(in, out_dtype, out, bias, m, n, k_is_zero, num_groups, workspace)
//                             forward output rows no GEMM writes (setup.h's forward_row_fill)
//   grouped_gemm(const GroupedGemmCall&, bool aligned)
//                             the workspace's problems; aligned: the tensor-core kernel
//   add_bias_rows(in, float* out, bias, m, n, num_groups, workspace)
//                             out[r] += bias[group of r], for a float32 output of 16-bit inputs
//   zero_empty_groups(out_dtype, out, block_elements, num_groups, workspace)
//                             wgrad: out[g] = 0 where the group's action is write_zero
//   bias_grad(in, out_dtype, grad, out, n, num_groups, workspace)
//                             out[g] = sum of group g's grad rows, in row order
#pragma once

#include <cstdint>
#include <initializer_list>

#include "groupgemm/types.h"
#include "setup.h"

namespace groupgemm {

// Operand storage of the three GEMM kinds, all with a row-major D:
//   row_row: forward / dgrad, A = lhs [m, k], B = rhs[g] [k, n]
//   row_col: forward / dgrad with rhs[g] stored [n, k]
//   col_row: wgrad, A = lhs_g^T (lhs_g is [rows, k]), B = grad_g [rows, n]
enum class GemmLayout : int { row_row = 0, row_col = 1, col_row = 2 };

// One grouped GEMM over the problems, pointers and leading dimensions in the workspace.
struct GroupedGemmCall {
  DType in_dtype;
  DType out_dtype;  // D, and C when beta != 0
  GemmLayout layout;
  int64_t num_groups;
  float beta;     // 0: D = A B;  1: D = A B + C (bias row, or D when accumulating)
  int64_t max_m;  // bound on any group's m
  int64_t n;      // every group's n
  const void* workspace;
};

inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 16-bit operands need every group's rows to start on a 16-byte boundary for the
// tensor-core kernel; float32 runs at any alignment. The choice depends on base
// addresses too, so a torch view at an odd storage offset runs the unaligned kernel:
// same values within rounding, but not the same bits as an aligned call.
inline bool tensor_core_aligned(DType in, int64_t k, int64_t n, std::initializer_list<const void*> ptrs) {
  if (in == DType::f32) return true;
  if (k % 8 != 0 || n % 8 != 0) return false;  // also covers float32 outputs (4 per 16 bytes)
  for (const void* p : ptrs)
    if (p && !is_aligned16(p)) return false;
  return true;
}

// Forward / dgrad: setup, the fill kernel (padding rows; every owned row when K = 0),
// one grouped GEMM, and the late bias when the epilogue cannot add it.
template <typename Launcher>
Status enqueue_grouped_matmul(const MatmulArgs& a, void* workspace, Launcher& launch) {
  if (a.m == 0 || a.n == 0) return Status::Ok();  // the output is empty
  GG_RETURN_IF_ERROR(launch.start());
  // The epilogue adds C in the output dtype: a bias of another dtype is added afterwards.
  const bool bias_in_epilogue = a.bias && a.out_dtype == a.in_dtype;
  const int64_t in_bytes = dtype_size(a.in_dtype), out_bytes = dtype_size(a.out_dtype);
  const GemmOperands ops{a.lhs,    a.rhs,    bias_in_epilogue ? a.bias : nullptr, a.out, in_bytes, in_bytes,
                         in_bytes, out_bytes};
  GG_RETURN_IF_ERROR(launch.setup({SetupKind::forward, a.group_sizes, a.group_offset, a.num_groups, a.m, a.k,
                                   a.n, a.transpose_rhs, false, ops, workspace}));
  GG_RETURN_IF_ERROR(
      launch.fill_rows(a.in_dtype, a.out_dtype, a.out, a.bias, a.m, a.n, a.k == 0, a.num_groups, workspace));
  if (a.k == 0 || a.num_groups == 0) return Status::Ok();  // the fill wrote every row

  const GemmLayout layout = a.transpose_rhs ? GemmLayout::row_col : GemmLayout::row_row;
  const bool aligned =
      tensor_core_aligned(a.in_dtype, a.k, a.n, {a.lhs, a.rhs, a.out, bias_in_epilogue ? a.bias : nullptr});
  GG_RETURN_IF_ERROR(launch.grouped_gemm(
      {a.in_dtype, a.out_dtype, layout, a.num_groups, bias_in_epilogue ? 1.0f : 0.0f, a.m, a.n, workspace},
      aligned));
  if (a.bias && !bias_in_epilogue)
    return launch.add_bias_rows(a.in_dtype, static_cast<float*>(a.out), a.bias, a.m, a.n, a.num_groups,
                                workspace);
  return Status::Ok();
}

// Weight gradient: setup, zeros for empty groups (unless accumulating), one grouped GEMM.
template <typename Launcher>
Status enqueue_grouped_matmul_wgrad(const WgradArgs& a, void* workspace, Launcher& launch) {
  if (a.num_groups == 0 || a.k == 0 || a.n == 0) return Status::Ok();  // the output is empty
  GG_RETURN_IF_ERROR(launch.start());
  const int64_t in_bytes = dtype_size(a.in_dtype), out_bytes = dtype_size(a.out_dtype);
  const GemmOperands ops{a.lhs,     a.grad,   a.accumulate ? a.out : nullptr, a.out, in_bytes, in_bytes,
                         out_bytes, out_bytes};
  GG_RETURN_IF_ERROR(launch.setup({SetupKind::wgrad, a.group_sizes, a.group_offset, a.num_groups, a.m, a.k,
                                   a.n, false, a.accumulate, ops, workspace}));
  if (!a.accumulate)
    GG_RETURN_IF_ERROR(launch.zero_empty_groups(a.out_dtype, a.out, a.k * a.n, a.num_groups, workspace));
  if (a.m == 0) return Status::Ok();  // every group is empty
  const bool aligned = tensor_core_aligned(a.in_dtype, a.k, a.n, {a.lhs, a.grad, a.out});
  return launch.grouped_gemm({a.in_dtype, a.out_dtype, GemmLayout::col_row, a.num_groups,
                              a.accumulate ? 1.0f : 0.0f, a.k, a.n, workspace},
                             aligned);
}

// Bias gradient: setup (row boundaries only), then the column sums.
template <typename Launcher>
Status enqueue_grouped_bias_grad(const BiasGradArgs& a, void* workspace, Launcher& launch) {
  if (a.num_groups == 0 || a.n == 0) return Status::Ok();  // the output is empty
  GG_RETURN_IF_ERROR(launch.start());
  GG_RETURN_IF_ERROR(launch.setup({SetupKind::rows_only,
                                   a.group_sizes,
                                   a.group_offset,
                                   a.num_groups,
                                   a.m,
                                   0,
                                   a.n,
                                   false,
                                   false,
                                   {},
                                   workspace}));
  return launch.bias_grad(a.in_dtype, a.out_dtype, a.grad, a.out, a.n, a.num_groups, workspace);
}

}  // namespace groupgemm
