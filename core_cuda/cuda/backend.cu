// CUDA backend entry points. Each call checks what only the CUDA backend needs (int32
// problem sizes, the workspace, a usable device), then enqueues the call sequence of
// call_sequence.h on the caller's stream without any host synchronisation: the setup
// kernel (device group sizes -> workspace, and the rows and groups no GEMM writes), then
// the grouped GEMMs. Nothing is allocated and nothing is copied to the host, so the
// sequence can be captured in a CUDA graph. The device's facts come from a per-device
// cache (device_info.h), so a call makes no device query after the first.
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "backends.h"
#include "call_sequence.h"
#include "device_checks.h"
#include "gemm_sm90.h"
#include "grouped_gemm.h"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

// CUTLASS's problem sizes and tile arithmetic are int32 and add up to a tile (128) to a
// dimension before dividing, so leave that much headroom below 2^31.
Status check_int32(int64_t m, int64_t k, int64_t n, int64_t num_groups) {
  const int64_t limit = std::numeric_limits<int32_t>::max() - 256;
  if (m > limit || k > limit || n > limit || num_groups > limit)
    return Status::Invalid("on CUDA, M, K, N and the group count must each be below 2^31 - 256");
  return Status::Ok();
}

Status check_workspace(const ExecContext& ctx, int64_t num_groups) {
  const int64_t need = workspace_layout(num_groups).bytes;
  if (ctx.workspace == nullptr || ctx.workspace_bytes < need)
    return Status::Invalid("workspace has " + std::to_string(ctx.workspace_bytes) +
                           " bytes, the call needs " + std::to_string(need) + " (see workspace_bytes)");
  if (!is_aligned16(ctx.workspace)) return Status::Invalid("workspace must be 16-byte aligned");
  return Status::Ok();
}

Status check_call(const ExecContext& ctx, int64_t m, int64_t k, int64_t n, int64_t num_groups) {
  Status s = check_int32(m, k, n, num_groups);
  if (s.ok()) s = check_workspace(ctx, num_groups);
  if (s.ok()) s = check_device();
  if (s.ok()) s = check_no_pending_error();
  return s;
}

GroupedGemmLaunch gemm_launch(const GroupedGemmCall& call, const DeviceInfo& device, cudaStream_t stream) {
  const GemmArrays ws = workspace_view(const_cast<void*>(call.workspace), call.num_groups).gemm[call.set];
  GroupedGemmLaunch l{};
  l.in_dtype = call.in_dtype, l.out_dtype = call.out_dtype, l.layout = call.layout;
  l.problems = ws.problem, l.num_groups = static_cast<int>(call.num_groups);
  for (int i = 0; i < 4; ++i) l.ptr[i] = ws.ptr[i], l.ld[i] = ws.ld[i];
  l.c = call.c, l.max_m = static_cast<int>(call.max_m), l.n = static_cast<int>(call.n);
  l.device = device, l.stream = stream;
  return l;
}

// The steps of call_sequence.h as CUDA launches on the caller's stream.
class CudaLauncher {
 public:
  explicit CudaLauncher(const ExecContext& ctx) : ctx_(ctx), stream_(static_cast<cudaStream_t>(ctx.stream)) {}

  Status start() {
    device_.emplace(ctx_);  // held until the launcher goes: every launch runs on that device
    GG_RETURN_IF_ERROR(device_->status());
    GG_RETURN_IF_ERROR(current_device_info(&device_info_));
    choice_ = choose_kernel(device_info_);  // kernel_choice.h
    return choice_.status;
  }
  Status setup(const SetupArgs& args) { return launch_setup(args, stream_); }
  Status grouped_gemm(const GroupedGemmCall& call, bool aligned) {
    const GroupedGemmLaunch launch = gemm_launch(call, device_info_, stream_);
    const GemmKernelChoice kernel = kernel_for(choice_, call, aligned);
    if (kernel.kernel == GemmKernel::sm90)
      return grouped_gemm_sm90(launch, kernel.tile, ctx_.workspace, ctx_.workspace_bytes);
    return cuda::grouped_gemm(launch, aligned);
  }
  Status bias_grad(DType in, DType out_dtype, const void* grad, void* out, int64_t n, int64_t num_groups,
                   const void* workspace) {
    return launch_bias_grad(in, out_dtype, grad, out, n, num_groups, workspace, stream_);
  }

 private:
  const ExecContext& ctx_;
  cudaStream_t stream_;
  std::optional<DeviceGuard> device_;
  DeviceInfo device_info_{};
  KernelChoice choice_{Status::Ok(), KernelPolicy::sm80, Sm90Tile{}};
};

}  // namespace

Status grouped_gemm(const GroupedGemmLaunch& launch, bool aligned) {
  switch (launch.in_dtype) {
    case DType::f32: return grouped_gemm_f32(launch);
    case DType::bf16: return aligned ? grouped_gemm_bf16(launch) : grouped_gemm_unaligned(launch);
    case DType::f16: return aligned ? grouped_gemm_f16(launch) : grouped_gemm_unaligned(launch);
    default: return Status::Invalid(std::string(dtype_name(launch.in_dtype)) + " is not supported on CUDA");
  }
}

int64_t grouped_matmul_kernel_workspace_bytes(int device_index) {
  return sm90_kernel_workspace_bytes(device_index);
}

Status grouped_matmul(const MatmulArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_call(ctx, a.m, a.k, a.n, a.num_groups));
  CudaLauncher launch(ctx);
  return enqueue_grouped_matmul(a, ctx.workspace, launch);
}

Status grouped_matmul_wgrad(const WgradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_call(ctx, a.m, a.k, a.n, a.num_groups));
  CudaLauncher launch(ctx);
  return enqueue_grouped_matmul_wgrad(a, ctx.workspace, launch);
}

Status grouped_bias_grad(const BiasGradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_call(ctx, a.m, 0, a.n, a.num_groups));
  CudaLauncher launch(ctx);
  return enqueue_grouped_bias_grad(a, ctx.workspace, launch);
}

Status grouped_matmul_backward(const BackwardArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_call(ctx, a.m, a.k, a.n, a.num_groups));
  CudaLauncher launch(ctx);
  return enqueue_grouped_matmul_backward(a, ctx.workspace, launch);
}

}  // namespace cuda
}  // namespace groupgemm
