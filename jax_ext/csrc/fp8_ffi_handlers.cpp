// XLA FFI handlers of the FP8 calls (groupgemm/fp8.h), in ffi_args.h's style (listed in
// fp8_ffi_handlers(); groupgemm.jax_ext.fp8_ffi_calls registers them). float8 buffers
// carry their format as their XLA element type (F8E4M3FN, F8E5M2), which the unpacking
// (fp8_args.h) reads; scales are F32. Attributes are typed: int32 for enums, int64 for
// counts, bool for flags.
#include <cstdint>
#include <optional>

#include "ffi_args.h"
#include "fp8_args.h"
#include "groupgemm/fp8.h"

namespace groupgemm {
namespace {

using namespace ffi_args;

constexpr char kScaling[] = "scaling", kPowerOfTwo[] = "power_of_two", kNumGroups[] = "num_groups",
               kHasBias[] = "has_bias", kAccumulate[] = "accumulate";
// No format beside a float8 buffer: its element type is its format.
constexpr std::nullopt_t kFromBuffer = std::nullopt;

Fp8Scaling scaling_of(int32_t scaling) { return static_cast<Fp8Scaling>(scaling); }

// x [R..., C] (a weight's [G, N, K] unreshaped) -> q (x's shape), scale.
ffi::Error quantize_rows_op(Device device, void* stream, Buf x, Out q, Out scale,
                            Attribute<int32_t, kScaling> scaling, Attribute<bool, kPowerOfTwo> power_of_two) {
  const QuantizeRowsArgs a = glue::quantize_rows_args(view(x, "x"), view(q, "q"), view(scale, "scale"),
                                                      kFromBuffer, scaling_of(*scaling), *power_of_two);
  return to_ffi(quantize_rows(a, context(device, stream)));
}
GROUPGEMM_FFI_TARGET("fp8_ffi_handlers", "groupgemm_fp8_quantize_rows", quantize_rows_op);

ffi::Error quantize_blocks_op(Device device, void* stream, Buf x, Out q, Out scale,
                              Attribute<bool, kPowerOfTwo> power_of_two) {
  const QuantizeBlocksArgs a = glue::quantize_blocks_args(view(x, "x"), view(q, "q"), view(scale, "scale"),
                                                          kFromBuffer, *power_of_two);
  return to_ffi(quantize_blocks(a, context(device, stream)));
}
GROUPGEMM_FFI_TARGET("fp8_ffi_handlers", "groupgemm_fp8_quantize_blocks", quantize_blocks_op);

ffi::Error quantize_grouped_op(Device device, void* stream, Buf x, Buf group_sizes, Buf group_offset, Out q,
                               Out scale, Out workspace, Attribute<int64_t, kNumGroups> num_groups,
                               Attribute<int32_t, kScaling> scaling,
                               Attribute<bool, kPowerOfTwo> power_of_two) {
  const QuantizeGroupedArgs a = glue::quantize_grouped_args(
      view(x, "x"), view(group_sizes, "group_sizes"), view(group_offset, "group_offset"), view(q, "q"),
      view(scale, "scale"), *num_groups, kFromBuffer, scaling_of(*scaling), *power_of_two);
  return to_ffi(quantize_grouped(a, context(device, stream, workspace)));
}
GROUPGEMM_FFI_TARGET("fp8_ffi_handlers", "groupgemm_fp8_quantize_grouped", quantize_grouped_op);

ffi::Error scaled_matmul_op(Device device, void* stream, Buf lhs, Buf rhs, Buf lhs_scale, Buf rhs_scale,
                            Buf group_sizes, Buf group_offset, Buf bias, Out out, Out workspace,
                            Attribute<int32_t, kScaling> scaling, Attribute<bool, kHasBias> has_bias) {
  const ScaledMatmulArgs a = glue::scaled_matmul_args(
      view(lhs, "lhs"), view(rhs, "rhs"), view(lhs_scale, "lhs_scale"), view(rhs_scale, "rhs_scale"),
      view(group_sizes, "group_sizes"), view(group_offset, "group_offset"), optional(bias, "bias", *has_bias),
      view(out, "out"), kFromBuffer, kFromBuffer, scaling_of(*scaling), false);
  return to_ffi(scaled_grouped_matmul(a, context(device, stream, workspace)));
}
GROUPGEMM_FFI_TARGET("fp8_ffi_handlers", "groupgemm_scaled_matmul", scaled_matmul_op);

// acc is aliased to out when accumulating (input_output_aliases): out already holds it.
ffi::Error scaled_wgrad_op(Device device, void* stream, Buf lhs, Buf rhs, Buf lhs_scale, Buf rhs_scale,
                           Buf group_sizes, Buf group_offset, Buf acc, Out out, Out workspace,
                           Attribute<int32_t, kScaling> scaling, Attribute<bool, kAccumulate> accumulate) {
  (void)acc;
  const ScaledWgradArgs a = glue::scaled_wgrad_args(
      view(lhs, "lhs"), view(rhs, "rhs"), view(lhs_scale, "lhs_scale"), view(rhs_scale, "rhs_scale"),
      view(group_sizes, "group_sizes"), view(group_offset, "group_offset"), view(out, "out"), kFromBuffer,
      kFromBuffer, scaling_of(*scaling), *accumulate, false);
  return to_ffi(scaled_grouped_matmul_wgrad(a, context(device, stream, workspace)));
}
GROUPGEMM_FFI_TARGET("fp8_ffi_handlers", "groupgemm_scaled_wgrad", scaled_wgrad_op);

}  // namespace
}  // namespace groupgemm
