// Validation and device dispatch of the fused expert MLP (groupgemm/expert_mlp.h). Only
// host-visible facts are checked here; the expert ids and group_offset stay on the device.
#include <limits>
#include <string>

#include "arg_checks.h"
#include "backends.h"
#include "expert_checks.h"
#include "expert_mlp_workspace.h"
#include "groupgemm/groupgemm.h"

namespace groupgemm {
namespace {

// What the forward and the backward share: sizes, dtypes, the routing and the weights.
template <typename Args>
Status check_common(const Args& a, const ExecContext& ctx, const char* op) {
  GG_RETURN_IF_ERROR(check_non_negative(
      {{"T", a.num_tokens}, {"k", a.top_k}, {"H", a.hidden}, {"F_in", a.in_features}, {"E", a.num_experts}},
      op));
  GG_RETURN_IF_ERROR(check_device_dtype(a.dtype, ctx.device));
  GG_RETURN_IF_ERROR(check_slots(a.num_tokens, a.top_k));
  GG_RETURN_IF_ERROR(check_activation(a.activation, a.in_features, "fc1's output"));
  if (a.num_experts >= std::numeric_limits<int32_t>::max())
    return Status::Invalid(std::string(op) + ": E must be below 2^31 - 1, got " +
                           std::to_string(a.num_experts));
  const int64_t slots = a.num_tokens * a.top_k;
  if (a.expert_indices.count != slots)
    return Status::Invalid("expert_indices has " + std::to_string(a.expert_indices.count) +
                           " entries, expected T * k = " + std::to_string(slots));
  GG_RETURN_IF_ERROR(check_ptr(a.expert_indices.data, slots, "expert_indices"));
  if (a.group_offset.data != nullptr && a.group_offset.count != 1)
    return Status::Invalid("group_offset must be a scalar");
  GG_RETURN_IF_ERROR(check_probs_dtype(a.probs != nullptr, a.probs_dtype, a.dtype));
  const int64_t f = activation_out_features(a.activation, a.in_features);
  GG_RETURN_IF_ERROR(check_ptr(a.tokens, a.num_tokens * a.hidden, "tokens"));
  GG_RETURN_IF_ERROR(check_ptr(a.w_in, a.num_experts * a.hidden * a.in_features, "w_in"));
  return check_ptr(a.w_out, a.num_experts * f * a.hidden, "w_out");
}

}  // namespace

int64_t expert_mlp_workspace_bytes(Device device, int64_t num_slots, int64_t num_experts, int64_t hidden,
                                   int64_t in_features, Activation activation, int64_t value_bytes,
                                   bool backward) {
  if (device != Device::cuda) return 0;
  auto at_least_0 = [](int64_t v) { return v < 0 ? int64_t(0) : v; };
  in_features = at_least_0(in_features);
  const int64_t out_features = activation_out_features(activation, in_features);
  return expert_mlp_layout({at_least_0(num_slots), at_least_0(num_experts), at_least_0(hidden), in_features,
                            out_features, at_least_0(value_bytes), backward})
      .bytes;
}

Status expert_mlp(const ExpertMlpArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_common(a, ctx, "expert_mlp"));
  GG_RETURN_IF_ERROR(check_ptr(a.out, a.num_tokens * a.hidden, "out"));
  GG_RETURN_IF_ERROR(check_ptr(a.expert_rows, a.num_tokens * a.top_k * a.hidden, "expert_rows"));
  return dispatch(a, ctx, cpu::expert_mlp, cuda::expert_mlp);
}

Status expert_mlp_backward(const ExpertMlpBackwardArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_common(a, ctx, "expert_mlp_backward"));
  GG_RETURN_IF_ERROR(check_probs_dtype(a.dprobs != nullptr, a.probs_dtype, a.dtype));
  GG_RETURN_IF_ERROR(check_ptr(a.dout, a.num_tokens * a.hidden, "dout"));
  GG_RETURN_IF_ERROR(check_ptr(a.h, a.num_tokens * a.top_k * a.in_features, "h"));
  if (a.dtokens) GG_RETURN_IF_ERROR(check_ptr(a.token_rows, a.num_tokens * a.top_k * a.hidden, "token_rows"));
  return dispatch(a, ctx, cpu::expert_mlp_backward, cuda::expert_mlp_backward);
}

}  // namespace groupgemm
