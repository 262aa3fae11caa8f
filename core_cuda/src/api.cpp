// Validation and device dispatch for the core API. Only host-visible facts are checked
// here (shapes, dtypes, pointers, counts); group sizes stay on the device and are
// clamped by the schedule instead.
#include <string>

#include "backends.h"
#include "groupgemm/groupgemm.h"
#include "workspace.h"

namespace groupgemm {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

Status check_dims(int64_t m, int64_t k, int64_t n, int64_t num_groups) {
  if (m < 0 || k < 0 || n < 0 || num_groups < 0)
    return Status::Invalid("dimensions must be non-negative, got M=" + str(m) + " K=" + str(k) +
                           " N=" + str(n) + " G=" + str(num_groups));
  return Status::Ok();
}

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

Status check_groups(const IndexArray& sizes, const IndexArray& offset, int64_t num_groups) {
  if (sizes.count < 0 || (sizes.count > 0 && sizes.data == nullptr))
    return Status::Invalid("group_sizes is missing");
  if (offset.data == nullptr) {
    if (sizes.count != num_groups)
      return Status::Invalid("group_sizes has " + str(sizes.count) + " entries but there are " +
                             str(num_groups) + " groups; pass group_offset to select a window");
  } else {
    if (offset.count != 1) return Status::Invalid("group_offset must be a scalar");
    if (sizes.count < num_groups)
      return Status::Invalid("group_sizes has " + str(sizes.count) + " entries, fewer than the " +
                             str(num_groups) + " local groups");
  }
  return Status::Ok();
}

Status check_ptr(const void* p, int64_t elements, const char* name) {
  if (elements > 0 && p == nullptr) return Status::Invalid(std::string(name) + " is null");
  return Status::Ok();
}

// Runs the CPU or the CUDA backend (no_cuda.cpp in builds without nvcc) for already
// validated arguments.
template <typename Args, typename Cpu, typename Cuda>
Status dispatch(const Args& args, const ExecContext& ctx, Cpu cpu_fn, Cuda cuda_fn) {
  if (ctx.device == Device::cpu) return cpu_fn(args);
  return cuda_fn(args, ctx);
}

}  // namespace

bool cuda_compiled() {
#ifdef GROUPGEMM_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int64_t grouped_matmul_workspace_bytes(Device device, int64_t num_groups) {
  // The CPU backend needs no workspace; the CUDA one needs the setup kernel's arrays,
  // whose size is known without the CUDA build (so frontends size it identically).
  return device == Device::cuda ? workspace_layout(num_groups < 0 ? 0 : num_groups).bytes : 0;
}

Status grouped_matmul(const MatmulArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_dims(a.m, a.k, a.n, a.num_groups));
  GG_RETURN_IF_ERROR(check_dtypes(a.in_dtype, a.out_dtype, ctx.device, false));
  GG_RETURN_IF_ERROR(check_groups(a.group_sizes, a.group_offset, a.num_groups));
  GG_RETURN_IF_ERROR(check_ptr(a.lhs, a.m * a.k, "lhs"));
  GG_RETURN_IF_ERROR(check_ptr(a.rhs, a.num_groups * a.k * a.n, "rhs"));
  GG_RETURN_IF_ERROR(check_ptr(a.out, a.m * a.n, "out"));
  return dispatch(a, ctx, cpu::grouped_matmul, cuda::grouped_matmul);
}

Status grouped_matmul_wgrad(const WgradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_dims(a.m, a.k, a.n, a.num_groups));
  GG_RETURN_IF_ERROR(check_dtypes(a.in_dtype, a.out_dtype, ctx.device, a.accumulate));
  GG_RETURN_IF_ERROR(check_groups(a.group_sizes, a.group_offset, a.num_groups));
  GG_RETURN_IF_ERROR(check_ptr(a.lhs, a.m * a.k, "lhs"));
  GG_RETURN_IF_ERROR(check_ptr(a.grad, a.m * a.n, "grad"));
  GG_RETURN_IF_ERROR(check_ptr(a.out, a.num_groups * a.k * a.n, "out"));
  return dispatch(a, ctx, cpu::grouped_matmul_wgrad, cuda::grouped_matmul_wgrad);
}

Status grouped_bias_grad(const BiasGradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_dims(a.m, 0, a.n, a.num_groups));
  GG_RETURN_IF_ERROR(check_dtypes(a.in_dtype, a.out_dtype, ctx.device, false));
  GG_RETURN_IF_ERROR(check_groups(a.group_sizes, a.group_offset, a.num_groups));
  GG_RETURN_IF_ERROR(check_ptr(a.grad, a.m * a.n, "grad"));
  GG_RETURN_IF_ERROR(check_ptr(a.out, a.num_groups * a.n, "out"));
  return dispatch(a, ctx, cpu::grouped_bias_grad, cuda::grouped_bias_grad);
}

}  // namespace groupgemm
