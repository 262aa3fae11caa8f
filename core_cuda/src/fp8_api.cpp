// Validation and device dispatch of the core's FP8 API (groupgemm/fp8.h). Only host-
// visible facts are checked (shapes, dtypes, pointers, counts); group sizes stay on the
// device. The Python contract (_contract.py) applies the same rules first, with the
// frontends' argument names.
#include <string>

#include "arg_checks.h"
#include "fp8_backends.h"
#include "fp8_workspace.h"
#include "groupgemm/fp8.h"

namespace groupgemm {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

bool valid_fp8(Fp8Type t) { return t == Fp8Type::e4m3 || t == Fp8Type::e5m2; }
bool valid_scaling(Fp8Scaling s) { return s == Fp8Scaling::rowwise || s == Fp8Scaling::blockwise; }

// What is quantized: float32, bfloat16 or float16, into either float8 format.
Status check_quantize(DType in, Fp8Type out, Fp8Scaling scaling) {
  if (in != DType::f32 && in != DType::bf16 && in != DType::f16)
    return Status::Invalid(std::string("x must be float32, bfloat16 or float16, got ") + dtype_name(in));
  if (!valid_fp8(out)) return Status::Invalid("the float8 type must be float8_e4m3fn or float8_e5m2");
  if (!valid_scaling(scaling)) return Status::Invalid("scaling must be rowwise or blockwise");
  return Status::Ok();
}

// The operand pair (lhs e4m3 or, as a gradient, e5m2; rhs e4m3), the recipe and the output.
Status check_gemm_types(Fp8Type lhs, Fp8Type rhs, Fp8Scaling scaling, DType out, bool accumulate) {
  if (!valid_fp8(lhs)) return Status::Invalid("lhs must be float8_e4m3fn or float8_e5m2");
  if (rhs != Fp8Type::e4m3)
    return Status::Invalid(
        std::string("rhs must be float8_e4m3fn (float8_e5m2 is for the lhs, a gradient), got ") +
        fp8_name(rhs));
  if (!valid_scaling(scaling)) return Status::Invalid("scaling must be rowwise or blockwise");
  if (accumulate && out != DType::f32)
    return Status::Invalid(std::string("accumulate_into must be float32, got ") + dtype_name(out));
  if (out != DType::bf16 && out != DType::f32)
    return Status::Invalid(std::string("the output dtype must be bfloat16 or float32, got ") +
                           dtype_name(out));
  return Status::Ok();
}

}  // namespace

int64_t fp8_workspace_bytes(Device device, Fp8Call call, Fp8Scaling scaling, int64_t num_groups, int64_t m,
                            int64_t k, int64_t n, int device_index) {
  // Like grouped_matmul_workspace_bytes: the layout is known without the CUDA build, so
  // the frontends size it identically; the GEMM kernel's own part depends on the device.
  if (device != Device::cuda) return 0;
  const auto clamp = [](int64_t v) { return v < 0 ? int64_t(0) : v; };
  return fp8_workspace_layout(
             call, scaling, clamp(num_groups), clamp(m), clamp(k), clamp(n),
             call == Fp8Call::quantize_grouped ? 0 : cuda::fp8_kernel_workspace_bytes(device_index))
      .bytes;
}

Status quantize_rows(const QuantizeRowsArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_dims(a.rows, a.cols, 0, 0));
  GG_RETURN_IF_ERROR(check_quantize(a.in_dtype, a.out_type, a.scaling));
  GG_RETURN_IF_ERROR(check_ptr(a.x, a.rows * a.cols, "x"));
  GG_RETURN_IF_ERROR(check_ptr(a.q, a.rows * a.cols, "q"));
  GG_RETURN_IF_ERROR(
      check_ptr(a.scale, a.scaling == Fp8Scaling::rowwise ? a.rows : a.rows * fp8_blocks(a.cols), "scale"));
  return dispatch(a, ctx, cpu::quantize_rows, cuda::quantize_rows);
}

Status quantize_blocks(const QuantizeBlocksArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_dims(a.rows, a.cols, 0, a.batch));
  GG_RETURN_IF_ERROR(check_quantize(a.in_dtype, a.out_type, Fp8Scaling::blockwise));
  GG_RETURN_IF_ERROR(check_ptr(a.x, a.batch * a.rows * a.cols, "x"));
  GG_RETURN_IF_ERROR(check_ptr(a.q, a.batch * a.rows * a.cols, "q"));
  GG_RETURN_IF_ERROR(check_ptr(a.scale, a.batch * fp8_blocks(a.rows) * fp8_blocks(a.cols), "scale"));
  return dispatch(a, ctx, cpu::quantize_blocks, cuda::quantize_blocks);
}

Status quantize_grouped(const QuantizeGroupedArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_dims(a.m, a.cols, 0, a.num_groups));
  GG_RETURN_IF_ERROR(check_quantize(a.in_dtype, a.out_type, a.scaling));
  GG_RETURN_IF_ERROR(check_groups(a.group_sizes, a.group_offset, a.num_groups));
  GG_RETURN_IF_ERROR(check_ptr(a.x, a.m * a.cols, "x"));
  GG_RETURN_IF_ERROR(check_ptr(a.q, a.m * a.cols, "q"));
  GG_RETURN_IF_ERROR(check_ptr(a.scale, token_scale_rows(a.scaling, a.m, a.num_groups) * a.cols, "scale"));
  return dispatch(a, ctx, cpu::quantize_grouped, cuda::quantize_grouped);
}

Status scaled_grouped_matmul(const ScaledMatmulArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_dims(a.m, a.k, a.n, a.num_groups));
  GG_RETURN_IF_ERROR(check_gemm_types(a.lhs_type, a.rhs_type, a.scaling, a.out_dtype, false));
  if (a.scaling == Fp8Scaling::blockwise && a.k % kFp8Block != 0)
    return Status::Invalid("blockwise scaling needs K (lhs's last dimension) to be a multiple of 128, got " +
                           str(a.k));
  GG_RETURN_IF_ERROR(check_groups(a.group_sizes, a.group_offset, a.num_groups));
  const bool rowwise = a.scaling == Fp8Scaling::rowwise;
  GG_RETURN_IF_ERROR(check_ptr(a.lhs, a.m * a.k, "lhs"));
  GG_RETURN_IF_ERROR(check_ptr(a.rhs, a.num_groups * a.n * a.k, "rhs"));
  GG_RETURN_IF_ERROR(check_ptr(a.lhs_scale, rowwise ? a.m : a.m * fp8_blocks(a.k), "lhs_scale"));
  GG_RETURN_IF_ERROR(
      check_ptr(a.rhs_scale, rowwise ? a.num_groups * a.n : a.num_groups * fp8_blocks(a.n) * fp8_blocks(a.k),
                "rhs_scale"));
  GG_RETURN_IF_ERROR(check_ptr(a.out, a.m * a.n, "out"));
  return dispatch(a, ctx, cpu::scaled_grouped_matmul, cuda::scaled_grouped_matmul);
}

Status scaled_grouped_matmul_wgrad(const ScaledWgradArgs& a, const ExecContext& ctx) {
  GG_RETURN_IF_ERROR(check_dims(a.m, a.k, a.n, a.num_groups));
  GG_RETURN_IF_ERROR(check_gemm_types(a.lhs_type, a.rhs_type, a.scaling, a.out_dtype, a.accumulate));
  GG_RETURN_IF_ERROR(check_groups(a.group_sizes, a.group_offset, a.num_groups));
  const int64_t scale_rows = token_scale_rows(a.scaling, a.m, a.num_groups);
  GG_RETURN_IF_ERROR(check_ptr(a.lhs, a.k * a.m, "lhs"));
  GG_RETURN_IF_ERROR(check_ptr(a.rhs, a.n * a.m, "rhs"));
  GG_RETURN_IF_ERROR(check_ptr(a.lhs_scale, scale_rows * a.k, "lhs_scale"));
  GG_RETURN_IF_ERROR(check_ptr(a.rhs_scale, scale_rows * a.n, "rhs_scale"));
  GG_RETURN_IF_ERROR(check_ptr(a.out, a.num_groups * a.k * a.n, "out"));
  return dispatch(a, ctx, cpu::scaled_grouped_matmul_wgrad, cuda::scaled_grouped_matmul_wgrad);
}

}  // namespace groupgemm
