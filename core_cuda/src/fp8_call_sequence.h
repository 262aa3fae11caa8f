// The CUDA backend's FP8 call sequences, written once: which steps each FP8 entry point
// runs, in which order, and its early exits. cuda/fp8_backend.cu runs them with a launcher
// that enqueues CUDA kernels; the core tests (tests/fp8_tests.cpp) with one that runs each
// step on the host, so the sequence and the workspace arithmetic the GPU relies on are
// tested without a GPU. Plain C++: no CUDA header.
//
// A launcher provides, each returning a Status (`s` the call's Fp8SetupArgs; a step reads
// the workspace setup() wrote):
//   start()                         once, first (CUDA: makes the operands' device current)
//   require_fp8_tensor_cores()      the scaled GEMMs: refuses a device without them
//   setup(s)                        device group sizes -> boundaries, first blocks, problems
//   relayout_scales(s)              matmul: the API's scales -> the kernel's [Kb][M_g], [Kb][N]
//   fill_rows(s, bias)              matmul: output rows no GEMM writes, and the bias rows
//   zero_empty_groups(s)            wgrad: out[g] = 0 for the groups without tokens
//   align_tokens(s)                 wgrad: operands copied 128-token aligned (+ rowwise scales)
//   grouped_gemm(s, lhs_type, beta) the FP8 grouped GEMM over the workspace's problems
//   quantize_grouped(args, s)       the grouped quantization, after setup()
#pragma once

#include <cstdint>

#include "fp8_workspace.h"
#include "groupgemm/fp8.h"

namespace groupgemm {

inline Fp8SetupArgs fp8_setup_args(Fp8SetupKind kind, Fp8Scaling scaling, const IndexArray& sizes,
                                   const IndexArray& offset, int64_t num_groups, int64_t m, int64_t k,
                                   int64_t n, const Fp8Operands& ops, const Fp8WorkspaceLayout& layout,
                                   void* workspace) {
  return {kind, scaling, sizes, offset, num_groups, m, k, n, ops, layout, workspace};
}

// Forward / dgrad: setup, the scales laid out for the kernel, the rows no GEMM writes (and
// the bias rows the epilogue adds with beta = 1), one grouped GEMM.
template <typename Launcher>
Status enqueue_scaled_matmul(const ScaledMatmulArgs& a, void* workspace, const Fp8WorkspaceLayout& layout,
                             Launcher& launch) {
  GG_RETURN_IF_ERROR(launch.start());
  GG_RETURN_IF_ERROR(launch.require_fp8_tensor_cores());
  if (a.m == 0 || a.n == 0) return Status::Ok();  // the output is empty
  const Fp8Operands ops{a.lhs, a.rhs, a.out, a.lhs_scale, a.rhs_scale, dtype_size(a.out_dtype)};
  const Fp8SetupArgs s = fp8_setup_args(Fp8SetupKind::matmul, a.scaling, a.group_sizes, a.group_offset,
                                        a.num_groups, a.m, a.k, a.n, ops, layout, workspace);
  GG_RETURN_IF_ERROR(launch.setup(s));
  const bool gemm = a.k > 0 && a.num_groups > 0;
  if (gemm) GG_RETURN_IF_ERROR(launch.relayout_scales(s));
  GG_RETURN_IF_ERROR(launch.fill_rows(s, a.bias));
  if (!gemm) return Status::Ok();  // the fill wrote every row
  return launch.grouped_gemm(s, a.lhs_type, a.bias ? 1.0f : 0.0f);
}

// Weight gradient: setup, zeros for empty groups (unless accumulating), the operands
// copied with every group 128-token aligned, one grouped GEMM.
template <typename Launcher>
Status enqueue_scaled_wgrad(const ScaledWgradArgs& a, void* workspace, const Fp8WorkspaceLayout& layout,
                            Launcher& launch) {
  GG_RETURN_IF_ERROR(launch.start());
  GG_RETURN_IF_ERROR(launch.require_fp8_tensor_cores());
  if (a.num_groups == 0 || a.k == 0 || a.n == 0) return Status::Ok();  // the output is empty
  const Fp8Operands ops{a.lhs, a.rhs, a.out, a.lhs_scale, a.rhs_scale, dtype_size(a.out_dtype)};
  const Fp8SetupArgs s = fp8_setup_args(Fp8SetupKind::wgrad, a.scaling, a.group_sizes, a.group_offset,
                                        a.num_groups, a.m, a.k, a.n, ops, layout, workspace);
  GG_RETURN_IF_ERROR(launch.setup(s));
  if (!a.accumulate) GG_RETURN_IF_ERROR(launch.zero_empty_groups(s));
  if (a.m == 0) return Status::Ok();  // every group is empty
  GG_RETURN_IF_ERROR(launch.align_tokens(s));
  return launch.grouped_gemm(s, a.lhs_type, a.accumulate ? 1.0f : 0.0f);
}

// The weight gradient's operand quantization: setup (boundaries and first blocks), then
// the blocks. Plain kernels: any GPU runs them.
template <typename Launcher>
Status enqueue_quantize_grouped(const QuantizeGroupedArgs& a, void* workspace,
                                const Fp8WorkspaceLayout& layout, Launcher& launch) {
  GG_RETURN_IF_ERROR(launch.start());
  const Fp8SetupArgs s = fp8_setup_args(Fp8SetupKind::rows_only, a.scaling, a.group_sizes, a.group_offset,
                                        a.num_groups, a.m, 0, a.cols, {}, layout, workspace);
  GG_RETURN_IF_ERROR(launch.setup(s));
  return launch.quantize_grouped(a, s);
}

}  // namespace groupgemm
