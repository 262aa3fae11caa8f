// CUDA entry points of the fused expert MLP: the checks only this backend needs (int32
// problem sizes, the workspace, a usable device), then expert_mlp_sequence.h's call
// sequence on the caller's stream: the routing's sort, the per-expert GEMM setup, the
// gathered grouped GEMMs (gathered_gemm.h) and the grouped path's own (grouped_gemm.h),
// and the small row kernels between them. Nothing is allocated and nothing is copied to
// the host (the kept-row count and the experts' rows stay on the device), so a call can be
// captured in a CUDA graph.
//
// The GEMMs are the CUTLASS 2.x kernels on every GPU by default. Under GROUPGEMM_CUDA_KERNEL
// (sm90 or a tile) on Hopper, A's gathered rows go through the sm_90a gathered kernel
// (gathered_kernel_choice.h); the other GEMMs stay on the 2.x kernels.
#include <limits>
#include <optional>
#include <string>

#include "backends.h"
#include "device_checks.h"
#include "expert_kernels.h"
#include "expert_mlp_kernels.h"
#include "gathered_gemm.h"
#include "gathered_kernel_choice.h"
#include "gemm_sm90.h"

namespace groupgemm {
namespace cuda {
namespace {

// CUTLASS's problem sizes are int32, with a tile's headroom (backend.cu's rule); a gather
// index (a token) and a kept row are int32 already.
template <typename Args>
Status check_call(const Args& a, const ExecContext& ctx, bool backward) {
  const int64_t limit = std::numeric_limits<int32_t>::max() - 256;
  if (a.num_tokens * a.top_k > limit || a.hidden > limit || a.in_features > limit)
    return Status::Invalid("on CUDA, T * k, H and F_in must each be below 2^31 - 256");
  const int64_t need = expert_mlp_layout(shape_of(a, backward)).bytes;
  if (ctx.workspace == nullptr || ctx.workspace_bytes < need)
    return Status::Invalid("workspace has " + std::to_string(ctx.workspace_bytes) +
                           " bytes, the call needs " + std::to_string(need) +
                           " (see expert_mlp_workspace_bytes)");
  if (!is_aligned16(ctx.workspace)) return Status::Invalid("workspace must be 16-byte aligned");
  GG_RETURN_IF_ERROR(check_device());
  return check_no_pending_error();
}

// The steps of expert_mlp_sequence.h as CUDA launches on the caller's stream.
class CudaLauncher {
 public:
  explicit CudaLauncher(const ExecContext& ctx) : ctx_(ctx), stream_(static_cast<cudaStream_t>(ctx.stream)) {}

  Status start() {
    device_.emplace(ctx_);  // held until the launcher goes: every launch runs on that device
    GG_RETURN_IF_ERROR(device_->status());
    GG_RETURN_IF_ERROR(current_device_info(&device_info_));
    choice_ = choose_kernel(device_info_);
    return choice_.status;
  }
  Status route(const ExpertRouteArgs& a) { return launch_expert_route(a, stream_); }
  Status setup(const ExpertSetupArgs& a) { return launch_expert_setup(a, stream_); }
  Status gemm(const ExpertGemmCall& c) {
    GroupedGemmLaunch l{};
    l.in_dtype = c.call.in_dtype, l.out_dtype = c.call.out_dtype, l.layout = c.call.layout;
    l.problems = c.arrays.problem, l.num_groups = static_cast<int>(c.call.num_groups);
    for (int i = 0; i < 4; ++i) l.ptr[i] = c.arrays.ptr[i], l.ld[i] = c.arrays.ld[i];
    l.c = c.call.c, l.max_m = static_cast<int>(c.call.max_m), l.n = static_cast<int>(c.call.n);
    l.device = device_info_, l.stream = stream_;
    if (c.gather == Gather::none) return grouped_gemm(l, c.aligned);
    const GatheredGemmLaunch gathered{l, c.gather_indices, c.gather};
    if (gathered_kernel_for(choice_, c.call, c.gather, c.aligned) == GemmKernel::sm90)
      return gathered_gemm_sm90(gathered);
    return gathered_gemm(gathered, c.aligned);
  }
  Status fill_rows(const ExpertFillArgs& a) { return launch_expert_fill_rows(a, stream_); }
  Status forward_rows(const ForwardRowsArgs& a) { return launch_forward_rows(a, stream_); }
  Status backward_rows(const BackwardRowsArgs& a) { return launch_backward_rows(a, stream_); }
  Status expert_sums(const ExpertSumArgs& a) { return launch_expert_sums(a, stream_); }
  Status zero_idle(const IdleFillArgs& a) { return launch_zero_idle(a, stream_); }
  Status unpermute(const UnpermuteArgs& a) { return launch_unpermute(a, stream_); }

 private:
  const ExecContext& ctx_;
  cudaStream_t stream_;
  std::optional<DeviceGuard> device_;
  DeviceInfo device_info_{};
  KernelChoice choice_{Status::Ok(), KernelPolicy::sm80, Sm90Tile{}};
};

}  // namespace

Status expert_mlp(const ExpertMlpArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_call(a, ctx, false));
  CudaLauncher launch(ctx);
  return enqueue_expert_mlp(a, ctx.workspace, launch);
}

Status expert_mlp_backward(const ExpertMlpBackwardArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_call(a, ctx, true));
  CudaLauncher launch(ctx);
  return enqueue_expert_mlp_backward(a, ctx.workspace, launch);
}

}  // namespace cuda
}  // namespace groupgemm
