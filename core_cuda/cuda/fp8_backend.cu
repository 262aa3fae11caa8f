// The CUDA backend's FP8 entry points. Each checks what only the CUDA backend needs (int32
// problem sizes, 16-byte rows and operands for TMA, the workspace, a usable device), then
// enqueues fp8_call_sequence.h's steps on the caller's stream without any host
// synchronisation or allocation, so a CUDA graph can capture the call. The scaled GEMMs
// need FP8 tensor cores: a compute capability 9.0 GPU and a build with sm_90a (elsewhere,
// sm_80 builds and GPUs included, they refuse with a clear error instead of running);
// the quantization kernels run on any GPU. The device's facts come from the per-device
// cache (device_info.h).
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

#include "device_checks.h"
#include "fp8_backends.h"
#include "fp8_call_sequence.h"
#include "fp8_kernels.h"
#include "fp8_sm90.h"
#include "kernel_choice.h"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

Status check_int32(std::initializer_list<int64_t> dims) {
  const int64_t limit = std::numeric_limits<int32_t>::max() - 256;
  for (int64_t d : dims)
    if (d > limit)
      return Status::Invalid("on CUDA, every FP8 dimension and the group count must be below 2^31 - 256");
  return Status::Ok();
}

Status check_workspace(const ExecContext& ctx, const Fp8WorkspaceLayout& layout) {
  if (ctx.workspace == nullptr || ctx.workspace_bytes < layout.bytes)
    return Status::Invalid("workspace has " + std::to_string(ctx.workspace_bytes) +
                           " bytes, the call needs " + std::to_string(layout.bytes) +
                           " (see fp8_workspace_bytes)");
  if (reinterpret_cast<uintptr_t>(ctx.workspace) % 16 != 0)
    return Status::Invalid("workspace must be 16-byte aligned");
  return Status::Ok();
}

// TMA reads and writes rows and operands at 16-byte boundaries: `rows` are (elements per
// row, element bytes, name).
Status check_tma(std::initializer_list<std::tuple<int64_t, int64_t, const char*>> rows,
                 std::initializer_list<std::pair<const void*, const char*>> operands) {
  for (const auto& [elements, bytes, name] : rows)
    if (elements * bytes % 16 != 0)
      return Status::Invalid(std::string("on CUDA the FP8 GEMMs read and write 16-byte rows: ") + name +
                             " must be a multiple of " + std::to_string(16 / bytes) + ", got " +
                             std::to_string(elements));
  for (const auto& [p, name] : operands)
    if (p && reinterpret_cast<uintptr_t>(p) % 16 != 0)
      return Status::Invalid(std::string("on CUDA the FP8 GEMMs need ") + name + " 16-byte aligned");
  return Status::Ok();
}

Status check_call(const ExecContext& ctx, const Fp8WorkspaceLayout& layout) {
  Status s = check_workspace(ctx, layout);
  if (s.ok()) s = check_device();
  if (s.ok()) s = check_no_pending_error();
  return s;
}

Fp8WorkspaceLayout layout_of(Fp8Call call, Fp8Scaling scaling, int64_t g, int64_t m, int64_t k, int64_t n,
                             const ExecContext& ctx) {
  return fp8_workspace_layout(
      call, scaling, g, m, k, n,
      call == Fp8Call::quantize_grouped ? 0 : fp8_kernel_workspace_bytes(ctx.device_index));
}

// fp8_call_sequence.h's steps as CUDA launches on the caller's stream.
class CudaFp8Launcher {
 public:
  explicit CudaFp8Launcher(const ExecContext& ctx)
      : ctx_(ctx), stream_(static_cast<cudaStream_t>(ctx.stream)) {}

  Status start() {
    device_.emplace(ctx_);  // held until the launcher goes: every launch runs on that device
    return device_->status();
  }
  Status require_fp8_tensor_cores() {
    GG_RETURN_IF_ERROR(current_device_info(&info_));
    if (fp8_sm90_built() && runs_sm90a(info_.cc_major, info_.cc_minor)) return Status::Ok();
    return Status::Unimplemented(
        "the CUDA FP8 grouped GEMMs need FP8 tensor cores: a compute capability 9.0 GPU (Hopper) and a build "
        "with the sm_90a kernels (CMAKE_CUDA_ARCHITECTURES with 90a); this device is " +
        std::to_string(info_.cc_major) + "." + std::to_string(info_.cc_minor) +
        (fp8_sm90_built() ? "" : " and this build has no sm_90a code"));
  }
  Status setup(const SetupArgs& s) { return launch_setup(s, stream_); }
  Status token_blocks(const Fp8SetupArgs& s) { return launch_fp8_token_blocks(s, stream_); }
  Status relayout_scales(const Fp8SetupArgs& s) { return launch_fp8_relayout_scales(s, stream_); }
  Status align_tokens(const Fp8SetupArgs& s) { return launch_fp8_align_tokens(s, stream_); }
  Status grouped_gemm(const Fp8SetupArgs& s, Fp8Type lhs_type, float beta) {
    const Fp8WorkspaceView ws = fp8_view(s);
    const GemmArrays& gemm = ws.base.gemm[kFp8GemmSet];
    const KernelWorkspace kernel = fp8_kernel_workspace(s.workspace, ctx_.workspace_bytes, s.layout);
    Fp8GemmLaunch l{};
    l.lhs_type = lhs_type, l.out_dtype = out_dtype_, l.num_groups = static_cast<int>(s.num_groups);
    l.problems = gemm.problem;
    for (int i = 0; i < 4; ++i) l.ptr[i] = gemm.ptr[i], l.ld[i] = gemm.ld[i];
    for (int i = 0; i < 2; ++i) l.scale[i] = ws.scale_ptr[i];
    l.beta = beta, l.device = info_;
    l.kernel_workspace = kernel.data, l.kernel_workspace_bytes = static_cast<size_t>(kernel.bytes);
    l.stream = stream_;
    return fp8_grouped_gemm_sm90(l);
  }
  Status quantize_grouped(const QuantizeGroupedArgs& a, const Fp8SetupArgs& s) {
    return launch_fp8_quantize_grouped(a, s, stream_);
  }
  void set_out_dtype(DType t) { out_dtype_ = t; }

 private:
  const ExecContext& ctx_;
  cudaStream_t stream_;
  std::optional<DeviceGuard> device_;
  DeviceInfo info_{};
  DType out_dtype_ = DType::bf16;
};

}  // namespace

int64_t fp8_kernel_workspace_bytes(int device_index) {
  if (!fp8_sm90_built() || !check_device().ok()) return 0;  // no driver or no device: nothing to size
  int device = device_index;
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  DeviceInfo info{};
  if (!device_info(device, &info).ok() || !runs_sm90a(info.cc_major, info.cc_minor)) return 0;
  return static_cast<int64_t>(fp8_sm90_workspace_bytes(info.sm_count));
}

Status scaled_grouped_matmul(const ScaledMatmulArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_int32({a.m, a.k, a.n, a.num_groups}));
  if (a.m > 0 && a.n > 0 && a.k > 0)
    GG_RETURN_IF_ERROR(check_tma({{a.k, 1, "K"}, {a.n, dtype_size(a.out_dtype), "N (the output's columns)"}},
                                 {{a.lhs, "lhs"}, {a.rhs, "rhs"}, {a.out, "out"}}));
  const Fp8WorkspaceLayout layout = layout_of(Fp8Call::matmul, a.scaling, a.num_groups, a.m, a.k, a.n, ctx);
  GG_RETURN_IF_ERROR(check_call(ctx, layout));
  CudaFp8Launcher launch(ctx);
  launch.set_out_dtype(a.out_dtype);
  return enqueue_scaled_matmul(a, ctx.workspace, layout, launch);
}

Status scaled_grouped_matmul_wgrad(const ScaledWgradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(
      check_int32({a.m, a.k, a.n, a.num_groups, token_block_bound(a.m, a.num_groups) * kFp8Block}));
  if (a.k > 0 && a.n > 0)
    GG_RETURN_IF_ERROR(
        check_tma({{a.n, dtype_size(a.out_dtype), "N (the output's columns)"}}, {{a.out, "out"}}));
  const Fp8WorkspaceLayout layout = layout_of(Fp8Call::wgrad, a.scaling, a.num_groups, a.m, a.k, a.n, ctx);
  GG_RETURN_IF_ERROR(check_call(ctx, layout));
  CudaFp8Launcher launch(ctx);
  launch.set_out_dtype(a.out_dtype);
  return enqueue_scaled_wgrad(a, ctx.workspace, layout, launch);
}

Status quantize_grouped(const QuantizeGroupedArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_int32({a.m, a.cols, a.num_groups}));
  const Fp8WorkspaceLayout layout =
      layout_of(Fp8Call::quantize_grouped, a.scaling, a.num_groups, a.m, 0, 0, ctx);
  GG_RETURN_IF_ERROR(check_call(ctx, layout));
  CudaFp8Launcher launch(ctx);
  return enqueue_quantize_grouped(a, ctx.workspace, layout, launch);
}

Status quantize_rows(const QuantizeRowsArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_device());
  GG_RETURN_IF_ERROR(check_no_pending_error());
  const DeviceGuard device(ctx);
  GG_RETURN_IF_ERROR(device.status());
  return launch_fp8_quantize_rows(a, static_cast<cudaStream_t>(ctx.stream));
}

Status quantize_blocks(const QuantizeBlocksArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_device());
  GG_RETURN_IF_ERROR(check_no_pending_error());
  const DeviceGuard device(ctx);
  GG_RETURN_IF_ERROR(device.status());
  return launch_fp8_quantize_blocks(a, static_cast<cudaStream_t>(ctx.stream));
}

}  // namespace cuda
}  // namespace groupgemm
