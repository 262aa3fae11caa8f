// XLA FFI handlers of the FP8 calls (groupgemm/fp8.h), CPU and CUDA, registered by
// groupgemm.jax_ext.fp8_raw. float8 buffers carry their format as their XLA element type
// (F8E4M3FN, F8E5M2); scales are F32. The CUDA handlers take XLA's stream through
// PlatformStream<void*> (no CUDA header here), allocate nothing (the workspace is an extra
// result) and are declared command-buffer compatible. Attributes are typed: int32 for
// enums, int64 for counts, bool for flags.
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "ffi_args.h"
#include "groupgemm/fp8.h"
#include "groupgemm/fp8_blocks.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace groupgemm {
namespace {

using namespace ffi_args;
using Buf = ffi::AnyBuffer;
using Out = ffi::Result<ffi::AnyBuffer>;

std::optional<Fp8Type> fp8_type(ffi::DataType t) {
  if (t == ffi::DataType::F8E4M3FN) return Fp8Type::e4m3;
  if (t == ffi::DataType::F8E5M2) return Fp8Type::e5m2;
  return std::nullopt;
}

bool scale_buffer(const ffi::AnyBuffer& b, const float** out) {
  if (b.element_type() != ffi::DataType::F32) return false;
  *out = static_cast<const float*>(b.untyped_data());
  return true;
}

ffi::Error quantize_rows_ffi(Device device, void* stream, Buf x, Out q, Out scale, int32_t scaling,
                             bool power_of_two) {
  QuantizeRowsArgs a;
  const auto out_type = fp8_type(q->element_type());
  if (!float_dtype(x.element_type(), &a.in_dtype) || !out_type) return dtype_error("fp8 quantize_rows");
  // x [R..., C]: rows are every index but the last (a weight's [G, N] comes unreshaped).
  const auto dims = x.dimensions();
  if (dims.size() < 2) return invalid("x must be at least 2-D");
  a.rows = 1, a.cols = dims[dims.size() - 1];
  for (size_t i = 0; i + 1 < dims.size(); ++i) a.rows *= dims[i];
  a.out_type = *out_type, a.scaling = static_cast<Fp8Scaling>(scaling), a.power_of_two = power_of_two;
  if (q->dimensions().size() != dims.size() || !std::equal(dims.begin(), dims.end(), q->dimensions().begin()))
    return shape_error("q");
  if (!count_is(*scale, row_scale_count(a.scaling, a.rows, a.cols))) return shape_error("scale");
  a.x = x.untyped_data(), a.q = q->untyped_data(), a.scale = static_cast<float*>(scale->untyped_data());
  return to_ffi(groupgemm::quantize_rows(a, plain_context(device, stream)));
}

ffi::Error quantize_blocks_ffi(Device device, void* stream, Buf x, Out q, Out scale, bool power_of_two) {
  QuantizeBlocksArgs a;
  const auto out_type = fp8_type(q->element_type());
  if (!float_dtype(x.element_type(), &a.in_dtype) || !out_type) return dtype_error("fp8 quantize_blocks");
  if (x.dimensions().size() != 3) return invalid("x must be 3-D");
  a.batch = x.dimensions()[0], a.rows = x.dimensions()[1], a.cols = x.dimensions()[2];
  a.out_type = *out_type, a.power_of_two = power_of_two;
  if (!shape_is(*q, {a.batch, a.rows, a.cols})) return shape_error("q");
  if (!count_is(*scale, block_scale_count(a.batch, a.rows, a.cols))) return shape_error("scale");
  a.x = x.untyped_data(), a.q = q->untyped_data(), a.scale = static_cast<float*>(scale->untyped_data());
  return to_ffi(groupgemm::quantize_blocks(a, plain_context(device, stream)));
}

ffi::Error quantize_grouped_ffi(Device device, void* stream, Buf x, Buf group_sizes, Buf group_offset, Out q,
                                Out scale, Out workspace, int64_t num_groups, int32_t scaling,
                                bool power_of_two) {
  QuantizeGroupedArgs a;
  const auto out_type = fp8_type(q->element_type());
  if (!float_dtype(x.element_type(), &a.in_dtype) || !out_type) return dtype_error("fp8 quantize_grouped");
  if (!index_array(group_sizes, &a.group_sizes) || !index_array(group_offset, &a.group_offset))
    return dtype_error("group_sizes/group_offset");
  if (x.dimensions().size() != 2) return invalid("x must be 2-D");
  if (num_groups < 0) return invalid("num_groups must be non-negative");
  a.m = x.dimensions()[0], a.cols = x.dimensions()[1], a.num_groups = num_groups;
  a.out_type = *out_type, a.scaling = static_cast<Fp8Scaling>(scaling), a.power_of_two = power_of_two;
  if (!shape_is(*q, {a.cols, a.m})) return shape_error("q");  // channel-major: the wgrad's operand
  if (!count_is(*scale, token_scale_rows(a.scaling, a.m, num_groups) * a.cols)) return shape_error("scale");
  a.x = x.untyped_data(), a.q = q->untyped_data(), a.scale = static_cast<float*>(scale->untyped_data());
  return to_ffi(groupgemm::quantize_grouped(a, context(device, stream, &*workspace)));
}

ffi::Error scaled_matmul_ffi(Device device, void* stream, Buf lhs, Buf rhs, Buf lhs_scale, Buf rhs_scale,
                             Buf group_sizes, Buf group_offset, Buf bias, Out out, Out workspace,
                             int32_t scaling, bool has_bias) {
  ScaledMatmulArgs a;
  const auto lhs_type = fp8_type(lhs.element_type()), rhs_type = fp8_type(rhs.element_type());
  if (!lhs_type || !rhs_type || !float_dtype(out->element_type(), &a.out_dtype) ||
      !scale_buffer(lhs_scale, &a.lhs_scale) || !scale_buffer(rhs_scale, &a.rhs_scale))
    return dtype_error("scaled_grouped_matmul");
  if (!index_array(group_sizes, &a.group_sizes) || !index_array(group_offset, &a.group_offset))
    return dtype_error("group_sizes/group_offset");
  const auto ld = lhs.dimensions(), rd = rhs.dimensions();
  if (ld.size() != 2 || rd.size() != 3) return invalid("bad operand rank");
  a.m = ld[0], a.k = ld[1], a.num_groups = rd[0], a.n = rd[1];
  a.lhs_type = *lhs_type, a.rhs_type = *rhs_type, a.scaling = static_cast<Fp8Scaling>(scaling);
  if (rd[2] != a.k) return shape_error("rhs");
  if (!shape_is(*out, {a.m, a.n})) return shape_error("out");
  if (!count_is(lhs_scale, row_scale_count(a.scaling, a.m, a.k))) return shape_error("lhs_scale");
  if (!count_is(rhs_scale, weight_scale_count(a.scaling, a.num_groups, a.n, a.k))) return shape_error("rhs_scale");
  if (has_bias && (!shape_is(bias, {a.num_groups, a.n}) || bias.element_type() != out->element_type()))
    return invalid("bias must be [G, N] in the output's dtype");
  a.lhs = lhs.untyped_data(), a.rhs = rhs.untyped_data(), a.out = out->untyped_data();
  a.bias = has_bias ? bias.untyped_data() : nullptr;
  return to_ffi(groupgemm::scaled_grouped_matmul(a, context(device, stream, &*workspace)));
}

// acc is aliased to out when accumulating (input_output_aliases): out already holds it.
ffi::Error scaled_wgrad_ffi(Device device, void* stream, Buf lhs, Buf rhs, Buf lhs_scale, Buf rhs_scale,
                            Buf group_sizes, Buf group_offset, Buf acc, Out out, Out workspace,
                            int32_t scaling, bool accumulate) {
  (void)acc;
  ScaledWgradArgs a;
  const auto lhs_type = fp8_type(lhs.element_type()), rhs_type = fp8_type(rhs.element_type());
  if (!lhs_type || !rhs_type || !float_dtype(out->element_type(), &a.out_dtype) ||
      !scale_buffer(lhs_scale, &a.lhs_scale) || !scale_buffer(rhs_scale, &a.rhs_scale))
    return dtype_error("scaled_grouped_matmul_wgrad");
  if (!index_array(group_sizes, &a.group_sizes) || !index_array(group_offset, &a.group_offset))
    return dtype_error("group_sizes/group_offset");
  const auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out->dimensions();
  if (ld.size() != 2 || rd.size() != 2 || od.size() != 3) return invalid("bad operand rank");
  a.k = ld[0], a.m = ld[1], a.n = rd[0], a.num_groups = od[0];
  a.lhs_type = *lhs_type, a.rhs_type = *rhs_type, a.scaling = static_cast<Fp8Scaling>(scaling);
  if (rd[1] != a.m) return shape_error("rhs");
  if (!shape_is(*out, {a.num_groups, a.k, a.n})) return shape_error("out");
  const int64_t scale_rows = token_scale_rows(a.scaling, a.m, a.num_groups);
  if (!count_is(lhs_scale, scale_rows * a.k)) return shape_error("lhs_scale");
  if (!count_is(rhs_scale, scale_rows * a.n)) return shape_error("rhs_scale");
  a.accumulate = accumulate;
  a.lhs = lhs.untyped_data(), a.rhs = rhs.untyped_data(), a.out = out->untyped_data();
  return to_ffi(groupgemm::scaled_grouped_matmul_wgrad(a, context(device, stream, &*workspace)));
}

// Each handler's CPU and CUDA variants: the CUDA one gets XLA's stream first.
template <auto Fn>
struct Variants {
  template <typename... Rest>
  static ffi::Error cpu(Rest... rest) {
    return Fn(Device::cpu, nullptr, rest...);
  }
  template <typename... Rest>
  static ffi::Error cuda(void* stream, Rest... rest) {
    return Fn(Device::cuda, stream, rest...);
  }
};

#define GG_FP8_HANDLERS(NAME, FN, TAIL, ...)                                                  \
  XLA_FFI_DEFINE_HANDLER(NAME##Cpu, (Variants<FN>::cpu<__VA_ARGS__>), ffi::Ffi::Bind() TAIL); \
  XLA_FFI_DEFINE_HANDLER(NAME##Cuda, (Variants<FN>::cuda<__VA_ARGS__>),                       \
                         ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>() TAIL,             \
                         {ffi::Traits::kCmdBufferCompatible});

// clang-format off
GG_FP8_HANDLERS(kQuantizeRows, quantize_rows_ffi,
                .Arg<Buf>().Ret<Buf>().Ret<Buf>().Attr<int32_t>("scaling").Attr<bool>("power_of_two"),
                Buf, Out, Out, int32_t, bool)
GG_FP8_HANDLERS(kQuantizeBlocks, quantize_blocks_ffi,
                .Arg<Buf>().Ret<Buf>().Ret<Buf>().Attr<bool>("power_of_two"),
                Buf, Out, Out, bool)
GG_FP8_HANDLERS(kQuantizeGrouped, quantize_grouped_ffi,
                .Arg<Buf>().Arg<Buf>().Arg<Buf>().Ret<Buf>().Ret<Buf>().Ret<Buf>()
                    .Attr<int64_t>("num_groups").Attr<int32_t>("scaling").Attr<bool>("power_of_two"),
                Buf, Buf, Buf, Out, Out, Out, int64_t, int32_t, bool)
GG_FP8_HANDLERS(kScaledMatmul, scaled_matmul_ffi,
                .Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Ret<Buf>().Ret<Buf>()
                    .Attr<int32_t>("scaling").Attr<bool>("has_bias"),
                Buf, Buf, Buf, Buf, Buf, Buf, Buf, Out, Out, int32_t, bool)
GG_FP8_HANDLERS(kScaledWgrad, scaled_wgrad_ffi,
                .Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Ret<Buf>().Ret<Buf>()
                    .Attr<int32_t>("scaling").Attr<bool>("accumulate"),
                Buf, Buf, Buf, Buf, Buf, Buf, Buf, Out, Out, int32_t, bool)
// clang-format on

nb::capsule capsule(XLA_FFI_Handler* fn) { return nb::capsule(reinterpret_cast<void*>(fn)); }

}  // namespace

void bind_fp8_ffi_handlers(nb::module_& m) {
  m.def(
      "fp8_ffi_handlers",
      [] {
        nb::dict cpu, cuda;
        cpu["groupgemm_fp8_quantize_rows"] = capsule(kQuantizeRowsCpu);
        cpu["groupgemm_fp8_quantize_blocks"] = capsule(kQuantizeBlocksCpu);
        cpu["groupgemm_fp8_quantize_grouped"] = capsule(kQuantizeGroupedCpu);
        cpu["groupgemm_scaled_matmul"] = capsule(kScaledMatmulCpu);
        cpu["groupgemm_scaled_wgrad"] = capsule(kScaledWgradCpu);
        cuda["groupgemm_fp8_quantize_rows"] = capsule(kQuantizeRowsCuda);
        cuda["groupgemm_fp8_quantize_blocks"] = capsule(kQuantizeBlocksCuda);
        cuda["groupgemm_fp8_quantize_grouped"] = capsule(kQuantizeGroupedCuda);
        cuda["groupgemm_scaled_matmul"] = capsule(kScaledMatmulCuda);
        cuda["groupgemm_scaled_wgrad"] = capsule(kScaledWgradCuda);
        nb::dict out;
        out["cpu"] = cpu;
        out["CUDA"] = cuda;
        return out;
      },
      "The FP8 XLA FFI handler capsules by platform, then target name.");
}

}  // namespace groupgemm
