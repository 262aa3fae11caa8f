// The CUDA backend's FP8 call sequences, written once: which steps each FP8 entry point
// runs, in which order, and its early exits. cuda/fp8_backend.cu runs them with a launcher
// that enqueues CUDA kernels; the core tests (tests/fp8_tests.cpp) with one that runs each
// step on the host, so the sequence and the workspace arithmetic the GPU relies on are
// tested without a GPU. Plain C++: no CUDA header.
//
// A launcher provides, each returning a Status and each one kernel launch unless it says
// otherwise (`s` the call's
// Fp8SetupArgs; a step reads the workspace the earlier ones wrote):
//   start()                         once, first (CUDA: makes the operands' device current)
//   require_fp8_tensor_cores()      the scaled GEMMs: refuses a device without them
//   setup(const SetupArgs&)         the 16-bit GEMMs' setup kernel (setup.h): device group
//                                   sizes -> row boundaries, the matmul's GEMM set, and the
//                                   output rows and groups no GEMM writes (a second
//                                   launch past 4096 local groups)
//   token_blocks(s)                 each local group's first token block; wgrad: its GEMM
//   relayout_scales(s)              matmul: the API's scales -> the kernel's [Kb][M_g], [Kb][N]
//   align_tokens(s)                 wgrad: operands copied 128-token aligned (+ rowwise scales)
//   grouped_gemm(s, lhs_type, beta) the FP8 grouped GEMM over GEMM set kFp8GemmSet
//   quantize_grouped(args, s)       the grouped quantization, after the setup (2 launches:
//                                   the padding's zeros, then the quantization)
//
// So a forward is 3 launches (setup, scales, GEMM), a weight gradient 4 (setup, token
// blocks, alignment, GEMM), up to 4096 local groups.
#pragma once

#include <cstdint>

#include "call_sequence.h"
#include "fp8_workspace.h"
#include "groupgemm/fp8.h"

namespace groupgemm {

// Forward / dgrad: the setup writes the GEMMs (out[rows] = lhs[rows] @ rhs[g]^T, rhs[g]
// stored [N, K]: the forward problem of a transposed rhs, on 1-byte operands) and every
// output row no GEMM writes alone: padding rows as zeros and, with a bias, each owned row
// as its group's bias, which the GEMM adds onto (C = D, beta = 1); with K = 0 or no local
// group, every row. Then the scales laid out for the kernel, and one grouped GEMM.
template <typename Launcher>
Status enqueue_scaled_matmul(const ScaledMatmulArgs& a, void* workspace, const Fp8WorkspaceLayout& layout,
                             Launcher& launch) {
  GG_RETURN_IF_ERROR(launch.start());
  GG_RETURN_IF_ERROR(launch.require_fp8_tensor_cores());
  if (a.m == 0 || a.n == 0) return Status::Ok();  // the output is empty
  const int64_t out_bytes = dtype_size(a.out_dtype);
  const bool gemm = a.k > 0 && a.num_groups > 0;
  SetupArgs setup = setup_of(a.group_sizes, a.group_offset, a.num_groups, a.m, workspace);
  setup.num_gemms = kFp8GemmSet + 1;
  setup.gemm[kFp8GemmSet] = {SetupKind::forward,
                             a.k,
                             a.n,
                             true,
                             true,
                             false,
                             GemmOperands{a.lhs, a.rhs, a.out, a.out, 1, 1, out_bytes, out_bytes}};
  setup.rows = {a.out, a.out_dtype, out_bytes, a.n, a.bias, a.out_dtype, !gemm || a.bias != nullptr};
  GG_RETURN_IF_ERROR(launch.setup(setup));
  if (!gemm) return Status::Ok();  // the setup wrote every row
  const Fp8Operands ops{a.lhs, a.rhs, a.out, a.lhs_scale, a.rhs_scale, out_bytes};
  const Fp8SetupArgs s{
      Fp8SetupKind::matmul, a.scaling, false, a.num_groups, a.m, a.k, a.n, ops, layout, workspace};
  GG_RETURN_IF_ERROR(launch.relayout_scales(s));
  return launch.grouped_gemm(s, a.lhs_type, a.bias ? 1.0f : 0.0f);
}

// Weight gradient: the setup (boundaries, and zeros for the empty groups unless
// accumulating), the first token blocks and each group's GEMM, the operands copied with
// every group 128-token aligned, one grouped GEMM.
template <typename Launcher>
Status enqueue_scaled_wgrad(const ScaledWgradArgs& a, void* workspace, const Fp8WorkspaceLayout& layout,
                            Launcher& launch) {
  GG_RETURN_IF_ERROR(launch.start());
  GG_RETURN_IF_ERROR(launch.require_fp8_tensor_cores());
  if (a.num_groups == 0 || a.k == 0 || a.n == 0) return Status::Ok();  // the output is empty
  const int64_t out_bytes = dtype_size(a.out_dtype);
  SetupArgs setup = setup_of(a.group_sizes, a.group_offset, a.num_groups, a.m, workspace);
  // The token-block step writes the GEMM set (its operands are the aligned copies), so the
  // setup writes none; the set's description gives the group fill its empty-group policy.
  setup.gemm[kFp8GemmSet] = {SetupKind::wgrad, a.k, a.n, false, false, a.accumulate, GemmOperands{}};
  if (!a.accumulate) setup.groups = {a.out, a.k * a.n * out_bytes, kFp8GemmSet};
  GG_RETURN_IF_ERROR(launch.setup(setup));
  if (a.m == 0) return Status::Ok();  // every group is empty
  const Fp8Operands ops{a.lhs, a.rhs, a.out, a.lhs_scale, a.rhs_scale, out_bytes};
  const Fp8SetupArgs s{
      Fp8SetupKind::wgrad, a.scaling, a.accumulate, a.num_groups, a.m, a.k, a.n, ops, layout, workspace};
  GG_RETURN_IF_ERROR(launch.token_blocks(s));
  GG_RETURN_IF_ERROR(launch.align_tokens(s));
  return launch.grouped_gemm(s, a.lhs_type, a.accumulate ? 1.0f : 0.0f);
}

// The weight gradient's operand quantization: the setup (row boundaries), the first token
// blocks (blockwise), then the blocks. Plain kernels: any GPU runs them.
template <typename Launcher>
Status enqueue_quantize_grouped(const QuantizeGroupedArgs& a, void* workspace,
                                const Fp8WorkspaceLayout& layout, Launcher& launch) {
  GG_RETURN_IF_ERROR(launch.start());
  GG_RETURN_IF_ERROR(launch.setup(setup_of(a.group_sizes, a.group_offset, a.num_groups, a.m, workspace)));
  const Fp8SetupArgs s{
      Fp8SetupKind::quantize_grouped, a.scaling, false, a.num_groups, a.m, 0, a.cols, {}, layout, workspace};
  if (a.scaling == Fp8Scaling::blockwise) GG_RETURN_IF_ERROR(launch.token_blocks(s));
  return launch.quantize_grouped(a, s);
}

}  // namespace groupgemm
