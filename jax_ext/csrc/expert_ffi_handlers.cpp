// XLA FFI handlers of the expert layer's ops: permute, unpermute and its backward, the
// activation and its backward, the router's softmax top-k, its backward and its tangent;
// in ffi_args.h's style, listed with the GEMMs' (ffi_handlers.cpp) in ffi_handlers(). Each
// op unpacks its buffers as the array entry points do (expert_args.h); the workspaces of
// permute and unpermute's backward are extra results.
#include <cstdint>

#include "expert_args.h"
#include "ffi_args.h"
#include "groupgemm/groupgemm.h"

namespace groupgemm {
namespace {

using namespace ffi_args;

constexpr char kHasProbs[] = "has_probs", kHasDpermuted[] = "has_dpermuted", kHasDprobs[] = "has_dprobs",
               kKind[] = "kind", kRenormalize[] = "renormalize";

// (tokens [T, H], expert_indices [T, k]) -> (permuted [T*k, H], group_sizes [E], row_map [T, k],
// workspace: permute_workspace_bytes(...) bytes, empty on CPU).
ffi::Error permute_op(Device device, void* stream, Buf tokens, Buf expert_indices, Out permuted,
                      Out group_sizes, Out row_map, Out workspace) {
  const PermuteArgs a = glue::permute_args(view(tokens, "tokens"), view(expert_indices, "expert_indices"),
                                           view(permuted, "permuted"), view(group_sizes, "group_sizes"),
                                           view(row_map, "row_map"));
  return to_ffi(permute(a, context(device, stream, workspace)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_permute", permute_op);

// (permuted [R, H], row_map [T, k], probs [T, k] or a size-0 placeholder) -> out [T, H].
ffi::Error unpermute_op(Device device, void* stream, Buf permuted, Buf row_map, Buf probs, Out out,
                        Attribute<bool, kHasProbs> has_probs) {
  const UnpermuteArgs a = glue::unpermute_args(view(permuted, "permuted"), view(row_map, "row_map"),
                                               optional(probs, "probs", *has_probs), view(out, "out"));
  return to_ffi(unpermute(a, context(device, stream)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_unpermute", unpermute_op);

// (dout [T, H], permuted [R, H] (read for dprobs only), row_map [T, k], probs) -> (dpermuted [R, H],
// dprobs [T, k], workspace: unpermute_backward_workspace_bytes(...) bytes, empty on CPU). An
// absent operand or an output not asked for is a size-0 placeholder; the flags say which.
ffi::Error unpermute_backward_op(Device device, void* stream, Buf dout, Buf permuted, Buf row_map, Buf probs,
                                 Out dpermuted, Out dprobs, Out workspace,
                                 Attribute<bool, kHasProbs> has_probs,
                                 Attribute<bool, kHasDpermuted> has_dpermuted,
                                 Attribute<bool, kHasDprobs> has_dprobs) {
  const UnpermuteBackwardArgs a = glue::unpermute_backward_args(
      view(dout, "dout"), optional(permuted, "permuted", *has_dprobs), view(row_map, "row_map"),
      optional(probs, "probs", *has_probs), optional(dpermuted, "dpermuted", *has_dpermuted),
      optional(dprobs, "dprobs", *has_dprobs));
  return to_ffi(unpermute_backward(a, context(device, stream, workspace)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_unpermute_backward", unpermute_backward_op);

// h [M, F_in] -> out [M, F]; kind is Activation's value.
ffi::Error activation_op(Device device, void* stream, Buf h, Out out, Attribute<int32_t, kKind> kind) {
  const ActivationArgs a =
      glue::activation_args(view(h, "h"), view(out, "out"), static_cast<Activation>(*kind));
  return to_ffi(activation(a, context(device, stream)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_activation", activation_op);

// (dout [M, F], h [M, F_in]) -> dh [M, F_in].
ffi::Error activation_backward_op(Device device, void* stream, Buf dout, Buf h, Out dh,
                                  Attribute<int32_t, kKind> kind) {
  const ActivationBackwardArgs a = glue::activation_backward_args(
      view(dout, "dout"), view(h, "h"), view(dh, "dh"), static_cast<Activation>(*kind));
  return to_ffi(activation_backward(a, context(device, stream)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_activation_backward", activation_backward_op);

// logits [T, E] -> (expert_indices [T, k] int32, probs [T, k]).
ffi::Error softmax_topk_op(Device device, void* stream, Buf logits, Out expert_indices, Out probs,
                           Attribute<bool, kRenormalize> renormalize) {
  const SoftmaxTopkArgs a = glue::softmax_topk_args(
      view(logits, "logits"), view(expert_indices, "expert_indices"), view(probs, "probs"), *renormalize);
  return to_ffi(softmax_topk(a, context(device, stream)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_softmax_topk", softmax_topk_op);

// (logits [T, E], expert_indices [T, k], dprobs [T, k]) -> dlogits [T, E].
ffi::Error softmax_topk_backward_op(Device device, void* stream, Buf logits, Buf expert_indices, Buf dprobs,
                                    Out dlogits, Attribute<bool, kRenormalize> renormalize) {
  const SoftmaxTopkBackwardArgs a =
      glue::softmax_topk_backward_args(view(logits, "logits"), view(expert_indices, "expert_indices"),
                                       view(dprobs, "dprobs"), view(dlogits, "dlogits"), *renormalize);
  return to_ffi(softmax_topk_backward(a, context(device, stream)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_softmax_topk_backward", softmax_topk_backward_op);

// Forward mode: (logits [T, E], expert_indices [T, k], tlogits [T, E]) -> tprobs [T, k].
ffi::Error softmax_topk_tangent_op(Device device, void* stream, Buf logits, Buf expert_indices, Buf tlogits,
                                   Out tprobs, Attribute<bool, kRenormalize> renormalize) {
  const SoftmaxTopkTangentArgs a =
      glue::softmax_topk_tangent_args(view(logits, "logits"), view(expert_indices, "expert_indices"),
                                      view(tlogits, "tlogits"), view(tprobs, "tprobs"), *renormalize);
  return to_ffi(softmax_topk_tangent(a, context(device, stream)));
}
GROUPGEMM_FFI_TARGET("ffi_handlers", "groupgemm_softmax_topk_tangent", softmax_topk_tangent_op);

}  // namespace

}  // namespace groupgemm
