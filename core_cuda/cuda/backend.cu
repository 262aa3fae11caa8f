// CUDA backend entry points. Each call enqueues, on the caller's stream and without any
// host synchronisation: the setup kernel (device group sizes -> workspace), the kernels
// for rows and groups no GEMM writes, and one grouped GEMM. Nothing is allocated and
// nothing is copied to the host, so the sequence can be captured in a CUDA graph.
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include "backends.h"
#include "grouped_gemm.h"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

// Makes the operands' device current for the call and restores the caller's afterwards.
// torch names the tensors' device; XLA passes a stream of the buffers' device.
class DeviceGuard {
 public:
  explicit DeviceGuard(const ExecContext& ctx) : stream_(static_cast<cudaStream_t>(ctx.stream)) {
    int device = ctx.device_index;
    if (device < 0 && stream_ && cudaStreamGetDevice(stream_, &device) != cudaSuccess) {
      status_ = Status::Internal("cannot find the CUDA device of the stream");
      return;
    }
    if (device < 0 || cudaGetDevice(&previous_) != cudaSuccess || previous_ == device) return;
    if (cudaSetDevice(device) != cudaSuccess) {
      status_ = Status::Internal("cannot select the operands' CUDA device");
      return;
    }
    switched_ = true;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  const Status& status() const { return status_; }
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_;
  Status status_;
  int previous_ = -1;
  bool switched_ = false;
};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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
    return Status::Invalid("workspace has " + std::to_string(ctx.workspace_bytes) + " bytes, the call needs " +
                           std::to_string(need) + " (see workspace_bytes)");
  if (!aligned16(ctx.workspace)) return Status::Invalid("workspace must be 16-byte aligned");
  return Status::Ok();
}

// Without a driver or a device, say so before any launch (the runtime's own message is
// "driver version is insufficient").
Status check_device() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e == cudaSuccess && count > 0) return Status::Ok();
  cudaGetLastError();  // clear the sticky error so later calls are not affected
  return Status::Internal(std::string("no usable CUDA device (") +
                          (e == cudaSuccess ? "none found" : cudaGetErrorString(e)) + ")");
}

// An error left pending by someone else's earlier launch would otherwise be reported
// (and cleared) as ours.
Status check_no_pending_error() {
  const cudaError_t e = cudaPeekAtLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string("an earlier CUDA error is pending: ") + cudaGetErrorString(e));
}

Status check_call(const ExecContext& ctx, int64_t m, int64_t k, int64_t n, int64_t num_groups) {
  Status s = check_int32(m, k, n, num_groups);
  if (s.ok()) s = check_workspace(ctx, num_groups);
  if (s.ok()) s = check_device();
  if (s.ok()) s = check_no_pending_error();
  return s;
}

// 16-bit operands need every group's rows to start on a 16-byte boundary for the
// tensor-core kernel; float32 runs at any alignment. The choice depends on base
// addresses too, so a torch view at an odd storage offset runs the unaligned kernel:
// same values within rounding, but not the same bits as an aligned call.
bool tensor_core_aligned(DType in, int64_t k, int64_t n, std::initializer_list<const void*> ptrs) {
  if (in == DType::f32) return true;
  if (k % 8 != 0 || n % 8 != 0) return false;  // also covers float32 outputs (4 per 16 bytes)
  for (const void* p : ptrs)
    if (p && !aligned16(p)) return false;
  return true;
}

GroupedGemmLaunch gemm_launch(DType in, DType out, GemmLayout layout, const ExecContext& ctx,
                              int64_t num_groups, float beta, int64_t max_m, int64_t n) {
  const WorkspaceView ws = workspace_view(ctx.workspace, num_groups);
  GroupedGemmLaunch l{};
  l.in_dtype = in, l.out_dtype = out, l.layout = layout;
  l.problems = ws.problem, l.num_groups = static_cast<int>(num_groups);
  for (int i = 0; i < 4; ++i) l.ptr[i] = ws.ptr[i], l.ld[i] = ws.ld[i];
  l.beta = beta, l.max_m = static_cast<int>(max_m), l.n = static_cast<int>(n);
  l.stream = static_cast<cudaStream_t>(ctx.stream);
  return l;
}

}  // namespace

Status grouped_gemm(const GroupedGemmLaunch& launch, bool aligned) {
  switch (launch.in_dtype) {
    case DType::f32: return grouped_gemm_f32(launch);
    case DType::bf16: return aligned ? grouped_gemm_bf16(launch) : grouped_gemm_unaligned(launch);
    case DType::f16: return aligned ? grouped_gemm_f16(launch) : grouped_gemm_unaligned(launch);
    default: return Status::Invalid(std::string(dtype_name(launch.in_dtype)) + " is not supported on CUDA");
  }
}

Status grouped_matmul(const MatmulArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_call(ctx, a.m, a.k, a.n, a.num_groups));
  if (a.m == 0 || a.n == 0) return Status::Ok();  // the output is empty
  const DeviceGuard device(ctx);
  GG_RETURN_IF_ERROR(device.status());
  const cudaStream_t stream = device.stream();
  // The epilogue adds C in the output dtype: a bias of another dtype is added afterwards.
  const bool bias_in_epilogue = a.bias && a.out_dtype == a.in_dtype;
  const int64_t in_bytes = dtype_size(a.in_dtype), out_bytes = dtype_size(a.out_dtype);
  const GemmOperands ops{a.lhs, a.rhs, bias_in_epilogue ? a.bias : nullptr, a.out,
                         in_bytes, in_bytes, in_bytes, out_bytes};
  GG_RETURN_IF_ERROR(launch_setup({SetupKind::forward, a.group_sizes, a.group_offset, a.num_groups,
                                        a.m, a.k, a.n, a.transpose_rhs, false, ops, ctx.workspace},
                                       stream));
  GG_RETURN_IF_ERROR(launch_fill_rows(a.in_dtype, a.out_dtype, a.out, a.bias, a.m, a.n, a.k == 0,
                                      a.num_groups, ctx.workspace, stream));
  if (a.k == 0 || a.num_groups == 0) return Status::Ok();  // the fill wrote every row

  const GemmLayout layout = a.transpose_rhs ? GemmLayout::row_col : GemmLayout::row_row;
  const bool aligned = tensor_core_aligned(a.in_dtype, a.k, a.n,
                                           {a.lhs, a.rhs, a.out, bias_in_epilogue ? a.bias : nullptr});
  GG_RETURN_IF_ERROR(grouped_gemm(
      gemm_launch(a.in_dtype, a.out_dtype, layout, ctx, a.num_groups, bias_in_epilogue ? 1.0f : 0.0f, a.m, a.n),
      aligned));
  if (a.bias && !bias_in_epilogue)
    return launch_add_bias_rows(a.in_dtype, static_cast<float*>(a.out), a.bias, a.m, a.n, a.num_groups,
                                ctx.workspace, stream);
  return Status::Ok();
}

Status grouped_matmul_wgrad(const WgradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_call(ctx, a.m, a.k, a.n, a.num_groups));
  if (a.num_groups == 0 || a.k == 0 || a.n == 0) return Status::Ok();  // the output is empty
  const DeviceGuard device(ctx);
  GG_RETURN_IF_ERROR(device.status());
  const cudaStream_t stream = device.stream();
  const int64_t in_bytes = dtype_size(a.in_dtype), out_bytes = dtype_size(a.out_dtype);
  const GemmOperands ops{a.lhs, a.grad, a.accumulate ? a.out : nullptr, a.out,
                         in_bytes, in_bytes, out_bytes, out_bytes};
  GG_RETURN_IF_ERROR(launch_setup({SetupKind::wgrad, a.group_sizes, a.group_offset, a.num_groups,
                                        a.m, a.k, a.n, false, a.accumulate, ops, ctx.workspace},
                                       stream));
  if (!a.accumulate)
    GG_RETURN_IF_ERROR(launch_zero_empty_groups(a.out_dtype, a.out, a.k * a.n, a.num_groups,
                                                     ctx.workspace, stream));
  if (a.m == 0) return Status::Ok();  // every group is empty
  const bool aligned = tensor_core_aligned(a.in_dtype, a.k, a.n, {a.lhs, a.grad, a.out});
  return grouped_gemm(gemm_launch(a.in_dtype, a.out_dtype, GemmLayout::col_row, ctx, a.num_groups,
                                  a.accumulate ? 1.0f : 0.0f, a.k, a.n),
                      aligned);
}

Status grouped_bias_grad(const BiasGradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_call(ctx, a.m, 0, a.n, a.num_groups));
  if (a.num_groups == 0 || a.n == 0) return Status::Ok();  // the output is empty
  const DeviceGuard device(ctx);
  GG_RETURN_IF_ERROR(device.status());
  const cudaStream_t stream = device.stream();
  GG_RETURN_IF_ERROR(launch_setup({SetupKind::rows_only, a.group_sizes, a.group_offset, a.num_groups,
                                        a.m, 0, a.n, false, false, {}, ctx.workspace},
                                       stream));
  return launch_bias_grad(a.in_dtype, a.out_dtype, a.grad, a.out, a.n, a.num_groups, ctx.workspace, stream);
}

}  // namespace cuda
}  // namespace groupgemm
