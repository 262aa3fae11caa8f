// Validation and device dispatch for the core API. Only host-visible facts are checked
// here (shapes, dtypes, pointers, counts); group sizes stay on the device and are
// clamped by the schedule instead.
#include <string>

#include <limits>

#include "arg_checks.h"
#include "backends.h"
#include "backward_parts.h"
#include "expert_checks.h"
#include "groupgemm/activation.h"
#include "groupgemm/groupgemm.h"
#include "permute_workspace.h"
#include "workspace.h"

namespace groupgemm {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

// Output is the input dtype or, for 16-bit inputs, float32. float64 is CPU-only.
Status check_dtypes(DType in, DType out, Device device, bool accumulate) {
  if (in == DType::f64 && device != Device::cpu) return Status::Invalid("float64 is supported on CPU only");
  if (accumulate) {
    const DType want = in == DType::f64 ? DType::f64 : DType::f32;
    if (out != want)
      return Status::Invalid(std::string("accumulate_into must be ") + dtype_name(want) + ", got " +
                             dtype_name(out));
    return Status::Ok();
  }
  const bool wider16 = (in == DType::bf16 || in == DType::f16) && out == DType::f32;
  if (out != in && !wider16)
    return Status::Invalid(std::string("output dtype ") + dtype_name(out) + " is not allowed for " +
                           dtype_name(in) + " inputs");
  return Status::Ok();
}

// The router: T tokens, E experts and k choices, with k at most E (a choice is an expert).
Status check_router(int64_t num_tokens, int64_t num_experts, int64_t top_k, const char* op) {
  GG_RETURN_IF_ERROR(check_non_negative({{"T", num_tokens}, {"E", num_experts}, {"k", top_k}}, op));
  if (top_k > num_experts)
    return Status::Invalid(std::string(op) + ": k = " + str(top_k) + " exceeds the " + str(num_experts) +
                           " experts");
  if (num_experts > std::numeric_limits<int32_t>::max())
    return Status::Invalid(std::string(op) + ": expert_indices are int32, E = " + str(num_experts) +
                           " does not fit");
  return Status::Ok();
}

}  // namespace

bool cuda_compiled() {
#ifdef GROUPGEMM_WITH_CUDA
  return true;
#else
  return false;
#endif
}

const char* cuda_architectures() { return cuda_compiled() ? GROUPGEMM_CUDA_ARCHS : ""; }

CaptureRecord cuda_capture_record() { return cuda::capture_record(); }

int64_t grouped_matmul_workspace_bytes(Device device, int64_t num_groups, int device_index) {
  // The CPU backend needs no workspace; the CUDA one needs the setup kernel's arrays,
  // whose size is known without the CUDA build (so frontends size it identically), and on
  // a device that runs the sm_90a kernels their own workspace, a function of its SM count.
  if (device != Device::cuda) return 0;
  return workspace_layout(num_groups < 0 ? 0 : num_groups,
                          cuda::grouped_matmul_kernel_workspace_bytes(device_index))
      .bytes;
}

int64_t permute_workspace_bytes(Device device, int64_t num_slots, int64_t num_experts) {
  if (device != Device::cuda) return 0;
  return permute_workspace_layout(num_slots < 0 ? 0 : num_slots, num_experts < 0 ? 0 : num_experts).bytes;
}

int64_t unpermute_backward_workspace_bytes(Device device, int64_t num_slots) {
  if (device != Device::cuda) return 0;
  return row_sort_workspace_layout(num_slots < 0 ? 0 : num_slots).bytes;
}

namespace {

// The checks of each entry point, before any backend runs.
Status check_matmul(const MatmulArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_dims(a.m, a.k, a.n, a.num_groups));
  GG_RETURN_IF_ERROR(check_dtypes(a.in_dtype, a.out_dtype, ctx.device, false));
  GG_RETURN_IF_ERROR(check_groups(a.group_sizes, a.group_offset, a.num_groups));
  GG_RETURN_IF_ERROR(check_ptr(a.lhs, a.m * a.k, "lhs"));
  GG_RETURN_IF_ERROR(check_ptr(a.rhs, a.num_groups * a.k * a.n, "rhs"));
  return check_ptr(a.out, a.m * a.n, "out");
}

Status check_wgrad(const WgradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_dims(a.m, a.k, a.n, a.num_groups));
  GG_RETURN_IF_ERROR(check_dtypes(a.in_dtype, a.out_dtype, ctx.device, a.accumulate));
  GG_RETURN_IF_ERROR(check_groups(a.group_sizes, a.group_offset, a.num_groups));
  GG_RETURN_IF_ERROR(check_ptr(a.lhs, a.m * a.k, "lhs"));
  GG_RETURN_IF_ERROR(check_ptr(a.grad, a.m * a.n, "grad"));
  return check_ptr(a.out, a.num_groups * a.k * a.n, "out");
}

Status check_bias_grad(const BiasGradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_dims(a.m, 0, a.n, a.num_groups));
  GG_RETURN_IF_ERROR(check_dtypes(a.in_dtype, a.out_dtype, ctx.device, false));
  GG_RETURN_IF_ERROR(check_groups(a.group_sizes, a.group_offset, a.num_groups));
  GG_RETURN_IF_ERROR(check_ptr(a.grad, a.m * a.n, "grad"));
  return check_ptr(a.out, a.num_groups * a.n, "out");
}

// A backward is valid when each requested gradient is valid as its separate call.
Status check_backward(const BackwardArgs& a, const ExecContext& ctx) {
  if (a.dlhs) GG_RETURN_IF_ERROR(check_matmul(dgrad_part(a), ctx));
  if (a.drhs) GG_RETURN_IF_ERROR(check_wgrad(wgrad_part(a), ctx));
  if (a.dbias) GG_RETURN_IF_ERROR(check_bias_grad(bias_grad_part(a), ctx));
  return Status::Ok();
}

}  // namespace

Status grouped_matmul(const MatmulArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_matmul(a, ctx));
  return dispatch(a, ctx, cpu::grouped_matmul, cuda::grouped_matmul);
}

Status grouped_matmul_wgrad(const WgradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_wgrad(a, ctx));
  return dispatch(a, ctx, cpu::grouped_matmul_wgrad, cuda::grouped_matmul_wgrad);
}

Status grouped_bias_grad(const BiasGradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_bias_grad(a, ctx));
  return dispatch(a, ctx, cpu::grouped_bias_grad, cuda::grouped_bias_grad);
}

Status grouped_matmul_backward(const BackwardArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_backward(a, ctx));
  return dispatch(a, ctx, cpu::grouped_matmul_backward, cuda::grouped_matmul_backward);
}

Status permute(const PermuteArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_non_negative(
      {{"T", a.num_tokens}, {"k", a.top_k}, {"H", a.hidden}, {"num_experts", a.num_experts}}, "permute"));
  GG_RETURN_IF_ERROR(check_device_dtype(a.dtype, ctx.device));
  GG_RETURN_IF_ERROR(check_slots(a.num_tokens, a.top_k));
  if (a.num_experts >= std::numeric_limits<int32_t>::max())
    return Status::Invalid("permute: num_experts must be below 2^31 - 1, got " + str(a.num_experts));
  const int64_t slots = a.num_tokens * a.top_k;
  if (a.expert_indices.count != slots)
    return Status::Invalid("expert_indices has " + str(a.expert_indices.count) +
                           " entries, expected T * k = " + str(slots));
  GG_RETURN_IF_ERROR(check_ptr(a.expert_indices.data, slots, "expert_indices"));
  GG_RETURN_IF_ERROR(check_ptr(a.tokens, a.num_tokens * a.hidden, "tokens"));
  GG_RETURN_IF_ERROR(check_ptr(a.permuted, slots * a.hidden, "permuted"));
  GG_RETURN_IF_ERROR(check_ptr(a.group_sizes, a.num_experts, "group_sizes"));
  GG_RETURN_IF_ERROR(check_ptr(a.row_map, slots, "row_map"));
  return dispatch(a, ctx, cpu::permute, cuda::permute);
}

Status unpermute(const UnpermuteArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_non_negative(
      {{"R", a.num_rows}, {"T", a.num_tokens}, {"k", a.top_k}, {"H", a.hidden}}, "unpermute"));
  GG_RETURN_IF_ERROR(check_device_dtype(a.dtype, ctx.device));
  GG_RETURN_IF_ERROR(check_slots(a.num_tokens, a.top_k));
  GG_RETURN_IF_ERROR(check_probs_dtype(a.probs != nullptr, a.probs_dtype, a.dtype));
  const int64_t slots = a.num_tokens * a.top_k;
  GG_RETURN_IF_ERROR(check_ptr(a.permuted, a.num_rows * a.hidden, "permuted"));
  GG_RETURN_IF_ERROR(check_ptr(a.row_map, slots, "row_map"));
  GG_RETURN_IF_ERROR(check_ptr(a.out, a.num_tokens * a.hidden, "out"));
  return dispatch(a, ctx, cpu::unpermute, cuda::unpermute);
}

Status unpermute_backward(const UnpermuteBackwardArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_non_negative(
      {{"R", a.num_rows}, {"T", a.num_tokens}, {"k", a.top_k}, {"H", a.hidden}}, "unpermute_backward"));
  GG_RETURN_IF_ERROR(check_device_dtype(a.dtype, ctx.device));
  GG_RETURN_IF_ERROR(check_slots(a.num_tokens, a.top_k));
  GG_RETURN_IF_ERROR(check_probs_dtype(a.probs || a.dprobs, a.probs_dtype, a.dtype));
  const int64_t slots = a.num_tokens * a.top_k;
  GG_RETURN_IF_ERROR(check_ptr(a.dout, a.num_tokens * a.hidden, "dout"));
  GG_RETURN_IF_ERROR(check_ptr(a.permuted, a.dprobs ? a.num_rows * a.hidden : 0, "permuted"));
  GG_RETURN_IF_ERROR(check_ptr(a.row_map, slots, "row_map"));
  return dispatch(a, ctx, cpu::unpermute_backward, cuda::unpermute_backward);
}

Status activation(const ActivationArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_non_negative({{"M", a.rows}, {"F_in", a.in_features}}, "activation"));
  GG_RETURN_IF_ERROR(check_activation(a.kind, a.in_features));
  GG_RETURN_IF_ERROR(check_device_dtype(a.dtype, ctx.device));
  GG_RETURN_IF_ERROR(check_ptr(a.h, a.rows * a.in_features, "h"));
  GG_RETURN_IF_ERROR(check_ptr(a.out, a.rows * activation_out_features(a.kind, a.in_features), "out"));
  return dispatch(a, ctx, cpu::activation, cuda::activation);
}

Status activation_backward(const ActivationBackwardArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_non_negative({{"M", a.rows}, {"F_in", a.in_features}}, "activation_backward"));
  GG_RETURN_IF_ERROR(check_activation(a.kind, a.in_features));
  GG_RETURN_IF_ERROR(check_device_dtype(a.dtype, ctx.device));
  GG_RETURN_IF_ERROR(check_ptr(a.dout, a.rows * activation_out_features(a.kind, a.in_features), "dout"));
  GG_RETURN_IF_ERROR(check_ptr(a.h, a.rows * a.in_features, "h"));
  GG_RETURN_IF_ERROR(check_ptr(a.dh, a.rows * a.in_features, "dh"));
  return dispatch(a, ctx, cpu::activation_backward, cuda::activation_backward);
}

Status softmax_topk(const SoftmaxTopkArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_router(a.num_tokens, a.num_experts, a.top_k, "softmax_topk"));
  GG_RETURN_IF_ERROR(check_device_dtype(a.dtype, ctx.device));
  GG_RETURN_IF_ERROR(check_ptr(a.logits, a.num_tokens * a.num_experts, "logits"));
  GG_RETURN_IF_ERROR(check_ptr(a.expert_indices, a.num_tokens * a.top_k, "expert_indices"));
  GG_RETURN_IF_ERROR(check_ptr(a.probs, a.num_tokens * a.top_k, "probs"));
  return dispatch(a, ctx, cpu::softmax_topk, cuda::softmax_topk);
}

Status softmax_topk_backward(const SoftmaxTopkBackwardArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_router(a.num_tokens, a.num_experts, a.top_k, "softmax_topk_backward"));
  GG_RETURN_IF_ERROR(check_device_dtype(a.dtype, ctx.device));
  GG_RETURN_IF_ERROR(check_ptr(a.logits, a.num_tokens * a.num_experts, "logits"));
  GG_RETURN_IF_ERROR(check_ptr(a.expert_indices, a.num_tokens * a.top_k, "expert_indices"));
  GG_RETURN_IF_ERROR(check_ptr(a.dprobs, a.num_tokens * a.top_k, "dprobs"));
  GG_RETURN_IF_ERROR(check_ptr(a.dlogits, a.num_tokens * a.num_experts, "dlogits"));
  return dispatch(a, ctx, cpu::softmax_topk_backward, cuda::softmax_topk_backward);
}

Status softmax_topk_tangent(const SoftmaxTopkTangentArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_router(a.num_tokens, a.num_experts, a.top_k, "softmax_topk_tangent"));
  GG_RETURN_IF_ERROR(check_device_dtype(a.dtype, ctx.device));
  GG_RETURN_IF_ERROR(check_ptr(a.logits, a.num_tokens * a.num_experts, "logits"));
  GG_RETURN_IF_ERROR(check_ptr(a.expert_indices, a.num_tokens * a.top_k, "expert_indices"));
  GG_RETURN_IF_ERROR(check_ptr(a.tlogits, a.num_tokens * a.num_experts, "tlogits"));
  GG_RETURN_IF_ERROR(check_ptr(a.tprobs, a.num_tokens * a.top_k, "tprobs"));
  return dispatch(a, ctx, cpu::softmax_topk_tangent, cuda::softmax_topk_tangent);
}

}  // namespace groupgemm
