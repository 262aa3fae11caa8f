// The CUDA backend's call sequence, written once: which steps each entry point runs, in
// which order, its early exits, and the choices between steps (where a bias enters the
// GEMM; tensor-core or unaligned grouped GEMM). cuda/backend.cu runs it with a launcher
// that enqueues the CUDA kernels; the core tests run it with a launcher that executes
// each step on the host, so the sequence the GPU runs is tested without one. Plain C++:
// no CUDA header.
//
// A launcher provides these members, each returning a Status and each one kernel launch
// unless it says otherwise (`workspace` is the call's, already written by setup() when a later step reads it):
//   start()                   once, after the early exits and before the first step
//                             (CUDA: makes the operands' device current)
//   setup(const SetupArgs&)   device group sizes -> workspace, and the output rows and
//                             blocks no GEMM writes (setup.h; a second launch past
//                             4096 local groups)
//   grouped_gemm(const GroupedGemmCall&, bool aligned)
//                             one GEMM set's problems; aligned: the tensor-core kernel
//   bias_grad(in, out_dtype, grad, out, n, num_groups, workspace)
//                             out[g] = sum of group g's grad rows (setup.h's lane order)
//
// So a forward is 2 launches (setup, GEMM), a backward 3 (setup, then the input and the
// weight gradient GEMMs) or 4 with a bias gradient, up to 4096 local groups.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "backward_parts.h"
#include "gemm_call.h"
#include "groupgemm/types.h"
#include "setup.h"

namespace groupgemm {

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

// A setup of the call's groups with no GEMM set and no fill yet.
inline SetupArgs setup_of(const IndexArray& sizes, const IndexArray& offset, int64_t num_groups, int64_t m,
                          void* workspace) {
  SetupArgs s{};
  s.group_sizes = sizes, s.group_offset = offset, s.num_groups = num_groups, s.m = m;
  s.num_gemms = 0, s.workspace = workspace;
  return s;
}

// A forward / dgrad product lhs [m, k] @ rhs[g] into out [m, n]: its GEMM set, and the
// row fill that writes its padding rows (and every owned row when K = 0).
struct ForwardProduct {
  DType in_dtype, out_dtype;
  const void *lhs, *rhs;
  void* out;
  int64_t m, k, n;
  bool transpose_rhs;
};

inline GemmSetup forward_gemm_setup(const ForwardProduct& f, const void* c, bool c_is_output) {
  const int64_t in_bytes = dtype_size(f.in_dtype), out_bytes = dtype_size(f.out_dtype);
  const int64_t c_bytes = c_is_output ? out_bytes : in_bytes;
  return {SetupKind::forward, f.k,     f.n,
          f.transpose_rhs,    c_is_output, false,
          GemmOperands{f.lhs, f.rhs, c, f.out, in_bytes, in_bytes, c_bytes, out_bytes}};
}

inline GroupedGemmCall forward_gemm_call(const ForwardProduct& f, int64_t num_groups, GemmC c, int set,
                                         const void* workspace) {
  return {f.in_dtype, f.out_dtype, f.transpose_rhs ? GemmLayout::row_col : GemmLayout::row_row,
          num_groups, c,           f.m,
          f.n,        set,         workspace};
}

// The weight-gradient product out[g] (+)= a_g^T @ b_g, a [m, k] and b [m, n].
struct WgradProduct {
  DType in_dtype, out_dtype;
  const void *a, *b;
  void* out;
  int64_t m, k, n;
  bool accumulate;
};

inline GemmSetup wgrad_gemm_setup(const WgradProduct& w) {
  const int64_t in_bytes = dtype_size(w.in_dtype), out_bytes = dtype_size(w.out_dtype);
  return {SetupKind::wgrad, w.k, w.n, false, false, w.accumulate,
          GemmOperands{w.a, w.b, w.accumulate ? w.out : nullptr, w.out, in_bytes, in_bytes, out_bytes, out_bytes}};
}

// Zeros for the empty groups' blocks of set `set`, unless accumulating (they stay untouched).
inline GroupFill wgrad_group_fill(const WgradProduct& w, int set) {
  if (w.accumulate) return {};
  return {w.out, w.k * w.n * dtype_size(w.out_dtype), set};
}

inline GroupedGemmCall wgrad_gemm_call(const WgradProduct& w, int64_t num_groups, int set, const void* workspace) {
  return {w.in_dtype, w.out_dtype, GemmLayout::col_row, num_groups, w.accumulate ? GemmC::output : GemmC::none,
          w.k,        w.n,         set,                 workspace};
}

inline bool forward_aligned(const ForwardProduct& f, const void* bias_row) {
  return tensor_core_aligned(f.in_dtype, f.k, f.n, {f.lhs, f.rhs, f.out, bias_row});
}

inline bool wgrad_aligned(const WgradProduct& w) { return tensor_core_aligned(w.in_dtype, w.k, w.n, {w.a, w.b, w.out}); }

// Forward / dgrad: setup (with the padding rows; every owned row when K = 0), one grouped
// GEMM. The bias enters the GEMM's epilogue as a broadcast row when it has the output's
// dtype; for a float32 output of 16-bit inputs, the setup writes each owned row's bias
// into the output and the GEMM adds onto it (C = D): the same float32 sum, one rounding.
template <typename Launcher>
Status enqueue_grouped_matmul(const MatmulArgs& a, void* workspace, Launcher& launch) {
  if (a.m == 0 || a.n == 0) return Status::Ok();  // the output is empty
  GG_RETURN_IF_ERROR(launch.start());
  const ForwardProduct f{a.in_dtype, a.out_dtype, a.lhs, a.rhs, a.out, a.m, a.k, a.n, a.transpose_rhs};
  const bool gemm = a.k > 0 && a.num_groups > 0;
  const bool bias_row = a.bias && a.out_dtype == a.in_dtype;
  const bool bias_prefilled = a.bias && !bias_row;
  SetupArgs s = setup_of(a.group_sizes, a.group_offset, a.num_groups, a.m, workspace);
  s.num_gemms = 1;
  s.gemm[0] = forward_gemm_setup(f, bias_row ? a.bias : nullptr, bias_prefilled);
  s.rows = {a.out, a.out_dtype, dtype_size(a.out_dtype), a.n, a.bias, a.in_dtype, !gemm || bias_prefilled};
  GG_RETURN_IF_ERROR(launch.setup(s));
  if (!gemm) return Status::Ok();  // the setup wrote every row
  const GemmC c = bias_row ? GemmC::bias_row : bias_prefilled ? GemmC::output : GemmC::none;
  return launch.grouped_gemm(forward_gemm_call(f, a.num_groups, c, 0, workspace),
                             forward_aligned(f, bias_row ? a.bias : nullptr));
}

// Weight gradient: setup (with zeros for empty groups unless accumulating), one grouped GEMM.
template <typename Launcher>
Status enqueue_grouped_matmul_wgrad(const WgradArgs& a, void* workspace, Launcher& launch) {
  if (a.num_groups == 0 || a.k == 0 || a.n == 0) return Status::Ok();  // the output is empty
  GG_RETURN_IF_ERROR(launch.start());
  const WgradProduct w{a.in_dtype, a.out_dtype, a.lhs, a.grad, a.out, a.m, a.k, a.n, a.accumulate};
  SetupArgs s = setup_of(a.group_sizes, a.group_offset, a.num_groups, a.m, workspace);
  s.num_gemms = 1;
  s.gemm[0] = wgrad_gemm_setup(w);
  s.groups = wgrad_group_fill(w, 0);
  GG_RETURN_IF_ERROR(launch.setup(s));
  if (a.m == 0) return Status::Ok();  // every group is empty
  return launch.grouped_gemm(wgrad_gemm_call(w, a.num_groups, 0, workspace), wgrad_aligned(w));
}

// Bias gradient: setup (row boundaries only), then the column sums.
template <typename Launcher>
Status enqueue_grouped_bias_grad(const BiasGradArgs& a, void* workspace, Launcher& launch) {
  if (a.num_groups == 0 || a.n == 0) return Status::Ok();  // the output is empty
  GG_RETURN_IF_ERROR(launch.start());
  GG_RETURN_IF_ERROR(launch.setup(setup_of(a.group_sizes, a.group_offset, a.num_groups, a.m, workspace)));
  return launch.bias_grad(a.in_dtype, a.out_dtype, a.grad, a.out, a.n, a.num_groups, workspace);
}

// The backward of a grouped_matmul: one setup for every requested gradient (set 0: the
// input gradient, set 1: the weight gradient; backward_parts.h), then their GEMMs and the
// bias gradient. Each GEMM and fill is the one the separate entry point would run, so the
// results are the same bits.
template <typename Launcher>
Status enqueue_grouped_matmul_backward(const BackwardArgs& a, void* workspace, Launcher& launch) {
  const MatmulArgs d = dgrad_part(a);
  const WgradArgs w = wgrad_part(a);
  const bool want_dlhs = a.dlhs && a.m > 0 && a.k > 0;
  const bool want_drhs = a.drhs && a.num_groups > 0 && a.k > 0 && a.n > 0;
  const bool want_dbias = a.dbias && a.num_groups > 0 && a.n > 0;
  if (!want_dlhs && !want_drhs && !want_dbias) return Status::Ok();  // every output is empty
  GG_RETURN_IF_ERROR(launch.start());
  const ForwardProduct dgrad{d.in_dtype, d.out_dtype, d.lhs, d.rhs, d.out, d.m, d.k, d.n, d.transpose_rhs};
  const WgradProduct wgrad{w.in_dtype, w.out_dtype, w.lhs, w.grad, w.out, w.m, w.k, w.n, w.accumulate};
  SetupArgs s = setup_of(a.group_sizes, a.group_offset, a.num_groups, a.m, workspace);
  s.num_gemms = 2;
  s.gemm[0] = forward_gemm_setup(dgrad, nullptr, false);
  s.gemm[1] = wgrad_gemm_setup(wgrad);
  if (want_dlhs) s.rows = {d.out, d.out_dtype, dtype_size(d.out_dtype), d.n, nullptr, d.in_dtype, d.k == 0};
  if (want_drhs) s.groups = wgrad_group_fill(wgrad, 1);
  GG_RETURN_IF_ERROR(launch.setup(s));
  if (want_dlhs && d.k > 0 && d.num_groups > 0)
    GG_RETURN_IF_ERROR(launch.grouped_gemm(forward_gemm_call(dgrad, d.num_groups, GemmC::none, 0, workspace),
                                           forward_aligned(dgrad, nullptr)));
  if (want_drhs && w.m > 0)
    GG_RETURN_IF_ERROR(launch.grouped_gemm(wgrad_gemm_call(wgrad, w.num_groups, 1, workspace), wgrad_aligned(wgrad)));
  if (!want_dbias) return Status::Ok();
  const BiasGradArgs b = bias_grad_part(a);
  return launch.bias_grad(b.in_dtype, b.out_dtype, b.grad, b.out, b.n, b.num_groups, workspace);
}

}  // namespace groupgemm
