// CUDA entry points of the expert layer's ops: the checks only this backend needs (the
// workspaces of permute and unpermute's backward, a usable device, no pending error),
// then the kernels on the caller's stream with the operands' device current. Nothing is
// allocated and nothing is copied to the host, so each call can be captured in a CUDA graph.
#include <string>

#include "backends.h"
#include "device_checks.h"
#include "expert_kernels.h"
#include "permute_workspace.h"

namespace groupgemm {
namespace cuda {
namespace {

Status check_workspace(const ExecContext& ctx, int64_t need, const char* op) {
  if (ctx.workspace == nullptr || ctx.workspace_bytes < need)
    return Status::Invalid("workspace has " + std::to_string(ctx.workspace_bytes) + " bytes, " + op +
                           " needs " + std::to_string(need) + " (see " + op + "_workspace_bytes)");
  if (reinterpret_cast<uintptr_t>(ctx.workspace) % 16 != 0)
    return Status::Invalid("workspace must be 16-byte aligned");
  return Status::Ok();
}

// Checks the device, makes it current and runs `launch(stream)` (unless there is no work).
template <typename Launch>
Status run(const ExecContext& ctx, bool empty, Launch launch) {
  GG_RETURN_IF_ERROR(check_device());
  GG_RETURN_IF_ERROR(check_no_pending_error());
  if (empty) return Status::Ok();
  DeviceGuard device(ctx);
  GG_RETURN_IF_ERROR(device.status());
  return launch(static_cast<cudaStream_t>(ctx.stream));
}

}  // namespace

Status permute(const PermuteArgs& a, const ExecContext& ctx) {
  const int64_t slots = a.num_tokens * a.top_k;
  GG_RETURN_IF_ERROR(check_workspace(ctx, permute_workspace_layout(slots, a.num_experts).bytes, "permute"));
  return run(ctx, slots == 0 && a.num_experts == 0,
             [&](cudaStream_t stream) { return launch_permute(a, ctx.workspace, stream); });
}

Status unpermute(const UnpermuteArgs& a, const ExecContext& ctx) {
  return run(ctx, a.num_tokens * a.hidden == 0,
             [&](cudaStream_t stream) { return launch_unpermute(a, stream); });
}

Status unpermute_backward(const UnpermuteBackwardArgs& a, const ExecContext& ctx) {
  const int64_t slots = a.num_tokens * a.top_k;
  const bool rows = a.dpermuted != nullptr && a.num_rows * a.hidden > 0,
             dots = a.dprobs != nullptr && slots > 0;
  if (rows && slots > 0)
    GG_RETURN_IF_ERROR(check_workspace(ctx, row_sort_workspace_layout(slots).bytes, "unpermute_backward"));
  return run(ctx, !rows && !dots,
             [&](cudaStream_t stream) { return launch_unpermute_backward(a, ctx.workspace, stream); });
}

Status activation(const ActivationArgs& a, const ExecContext& ctx) {
  return run(ctx, a.rows * a.in_features == 0,
             [&](cudaStream_t stream) { return launch_activation(a, stream); });
}

Status activation_backward(const ActivationBackwardArgs& a, const ExecContext& ctx) {
  return run(ctx, a.rows * a.in_features == 0,
             [&](cudaStream_t stream) { return launch_activation_backward(a, stream); });
}

Status softmax_topk(const SoftmaxTopkArgs& a, const ExecContext& ctx) {
  return run(ctx, a.num_tokens * a.top_k == 0,
             [&](cudaStream_t stream) { return launch_softmax_topk(a, stream); });
}

Status softmax_topk_backward(const SoftmaxTopkBackwardArgs& a, const ExecContext& ctx) {
  return run(ctx, a.num_tokens * a.num_experts == 0,
             [&](cudaStream_t stream) { return launch_softmax_topk_backward(a, stream); });
}

Status softmax_topk_tangent(const SoftmaxTopkTangentArgs& a, const ExecContext& ctx) {
  return run(ctx, a.num_tokens * a.top_k == 0,
             [&](cudaStream_t stream) { return launch_softmax_topk_tangent(a, stream); });
}

CaptureRecord capture_record() {
  const int first = g_first_under_capture.load();
  return {g_calls.load(), g_calls_under_capture.load(), first == 1};
}

}  // namespace cuda
}  // namespace groupgemm
