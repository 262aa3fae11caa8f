// XLA FFI handlers of the grouped GEMMs for groupgemm.jax: XLA buffers into core calls,
// one function per op in ffi_args.h's style (its CPU and CUDA handlers, XLA binding and
// registration are generated). The shapes were validated in Python at trace time; each op
// unpacks its buffers as the array entry points do (gemm_args.h), which checks them against
// the sizes it hands the core.
#include <nanobind/nanobind.h>

#include "ffi_args.h"
#include "gemm_args.h"
#include "groupgemm/groupgemm.h"

namespace nb = nanobind;

namespace groupgemm {

namespace {

using namespace ffi_args;

constexpr char kTransposeRhs[] = "transpose_rhs", kHasBias[] = "has_bias", kAccumulate[] = "accumulate",
               kWantDlhs[] = "want_dlhs", kWantDrhs[] = "want_drhs", kWantDbias[] = "want_dbias";

// out[M,N] = lhs @ rhs[g] (+ bias[g]); `bias` is a size-0 placeholder without has_bias.
ffi::Error matmul(Device device, void* stream, Buf lhs, Buf rhs, Buf group_sizes, Buf group_offset, Buf bias,
                  Out out, Out workspace, Attribute<bool, kTransposeRhs> transpose_rhs,
                  Attribute<bool, kHasBias> has_bias) {
  const MatmulArgs a =
      glue::matmul_args(view(lhs, "lhs"), view(rhs, "rhs"), view(group_sizes, "group_sizes"),
                        view(group_offset, "group_offset"), optional(bias, "bias", *has_bias),
                        view(out, "out"), *transpose_rhs, false);
  return to_ffi(grouped_matmul(a, context(device, stream, workspace)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_matmul", matmul);

// out[g] = lhs_g^T @ grad_g, or acc[g] + that when accumulating: acc is aliased to out
// (input_output_aliases), so XLA reuses a donated buffer or copies acc into out first, and
// acc itself is not read.
ffi::Error wgrad(Device device, void* stream, Buf lhs, Buf grad, Buf group_sizes, Buf group_offset, Buf acc,
                 Out out, Out workspace, Attribute<bool, kAccumulate> accumulate) {
  (void)acc;
  const WgradArgs a =
      glue::wgrad_args(view(lhs, "lhs"), view(grad, "grad"), view(group_sizes, "group_sizes"),
                       view(group_offset, "group_offset"), view(out, "out"), *accumulate, false);
  return to_ffi(grouped_matmul_wgrad(a, context(device, stream, workspace)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_wgrad", wgrad);

ffi::Error bias_grad(Device device, void* stream, Buf grad, Buf group_sizes, Buf group_offset, Out out,
                     Out workspace) {
  const BiasGradArgs a = glue::bias_grad_args(view(grad, "grad"), view(group_sizes, "group_sizes"),
                                              view(group_offset, "group_offset"), view(out, "out"), false);
  return to_ffi(grouped_bias_grad(a, context(device, stream, workspace)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_bias_grad", bias_grad);

// The gradients of a matmul from one core call; an unwanted gradient's result is a size-0
// placeholder.
ffi::Error matmul_backward(Device device, void* stream, Buf lhs, Buf rhs, Buf grad, Buf group_sizes,
                           Buf group_offset, Out dlhs, Out drhs, Out dbias, Out workspace,
                           Attribute<bool, kTransposeRhs> transpose_rhs, Attribute<bool, kWantDlhs> want_dlhs,
                           Attribute<bool, kWantDrhs> want_drhs, Attribute<bool, kWantDbias> want_dbias) {
  const BackwardArgs a =
      glue::matmul_backward_args(view(lhs, "lhs"), view(rhs, "rhs"), view(grad, "grad"),
                                 view(group_sizes, "group_sizes"), view(group_offset, "group_offset"),
                                 optional(dlhs, "dlhs", *want_dlhs), optional(drhs, "drhs", *want_drhs),
                                 optional(dbias, "dbias", *want_dbias), *transpose_rhs, false, false);
  return to_ffi(grouped_matmul_backward(a, context(device, stream, workspace)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_matmul_backward", matmul_backward);

}  // namespace

// The GEMMs' and the expert layer's targets, registered by groupgemm.jax at import; the FP8
// ones, by groupgemm.jax_ext.fp8_ffi_calls.
void bind_ffi_handlers(nb::module_& m) {
  ffi_args::def_targets(m, "ffi_handlers", "XLA FFI handler capsules by platform, then target name.");
  ffi_args::def_targets(m, "fp8_ffi_handlers",
                        "The FP8 XLA FFI handler capsules by platform, then target name.");
}

}  // namespace groupgemm
