// XLA FFI handlers for groupgemm.jax: translate XLA buffers into core calls.
//
// Each op has a CPU handler and a CUDA handler. The CUDA one receives XLA's stream
// through PlatformStream<void*> (so no CUDA header is needed here) and is declared
// command-buffer compatible: it reads group sizes on the device and allocates nothing.
// The shapes were validated in Python at trace time; each handler checks its buffers
// against the sizes it hands the core (ffi_args.h), which gets pointers only.
#include <nanobind/nanobind.h>

#include <optional>
#include <string>

#include "ffi_args.h"
#include "groupgemm/groupgemm.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace groupgemm {

// The expert layer's handlers, registered beside the GEMMs' (moe_ffi_handlers.cpp).
void add_moe_ffi_handlers(nb::dict& cpu, nb::dict& cuda);

namespace {

using namespace ffi_args;

// out[M,N] = lhs @ rhs[g] (+ bias[g]); `bias` is a size-0 placeholder when !has_bias.
ffi::Error matmul(Device device, void* stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                  ffi::AnyBuffer group_sizes, ffi::AnyBuffer group_offset, ffi::AnyBuffer bias,
                  ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, bool transpose_rhs,
                  bool has_bias) {
  MatmulArgs a;
  if (!float_dtype(lhs.element_type(), &a.in_dtype) || !float_dtype(out->element_type(), &a.out_dtype))
    return dtype_error("grouped_matmul");
  if (!index_array(group_sizes, &a.group_sizes) || !index_array(group_offset, &a.group_offset))
    return dtype_error("group_sizes/group_offset");
  const auto ld = lhs.dimensions(), rd = rhs.dimensions();
  if (ld.size() != 2 || rd.size() != 3) return invalid("bad operand rank");
  a.m = ld[0], a.k = ld[1], a.num_groups = rd[0], a.n = transpose_rhs ? rd[1] : rd[2];
  if ((transpose_rhs ? rd[2] : rd[1]) != a.k || rhs.element_type() != lhs.element_type())
    return shape_error("rhs");
  if (!shape_is(*out, {a.m, a.n})) return shape_error("out");
  if (has_bias && (!shape_is(bias, {a.num_groups, a.n}) || bias.element_type() != lhs.element_type()))
    return invalid("bias must be [G, N] in lhs's dtype");
  a.lhs = lhs.untyped_data(), a.rhs = rhs.untyped_data(), a.out = out->untyped_data();
  a.bias = has_bias ? bias.untyped_data() : nullptr;
  a.transpose_rhs = transpose_rhs;
  return to_ffi(grouped_matmul(a, context(device, stream, &*workspace)));
}

// out[g] = lhs_g^T @ grad_g, or acc[g] + that when accumulating (acc aliases out).
ffi::Error wgrad(Device device, void* stream, ffi::AnyBuffer lhs, ffi::AnyBuffer grad,
                 ffi::AnyBuffer group_sizes, ffi::AnyBuffer group_offset, ffi::AnyBuffer acc,
                 ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace, bool accumulate) {
  WgradArgs a;
  if (!float_dtype(lhs.element_type(), &a.in_dtype) || !float_dtype(out->element_type(), &a.out_dtype))
    return dtype_error("grouped_matmul_wgrad");
  if (!index_array(group_sizes, &a.group_sizes) || !index_array(group_offset, &a.group_offset))
    return dtype_error("group_sizes/group_offset");
  const auto ld = lhs.dimensions(), od = out->dimensions();
  if (ld.size() != 2 || od.size() != 3) return invalid("bad operand rank");
  a.m = ld[0], a.k = ld[1], a.num_groups = od[0], a.n = od[2];
  if (od[1] != a.k) return shape_error("out");
  if (!shape_is(grad, {a.m, a.n}) || grad.element_type() != lhs.element_type()) return shape_error("grad");
  a.lhs = lhs.untyped_data(), a.grad = grad.untyped_data(), a.out = out->untyped_data();
  a.accumulate = accumulate;
  // acc is aliased to out (input_output_aliases): XLA reuses a donated buffer or copies
  // acc into out first, so out already holds acc's values and acc itself is not read.
  (void)acc;
  return to_ffi(grouped_matmul_wgrad(a, context(device, stream, &*workspace)));
}

ffi::Error bias_grad(Device device, void* stream, ffi::AnyBuffer grad, ffi::AnyBuffer group_sizes,
                     ffi::AnyBuffer group_offset, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::AnyBuffer> workspace) {
  BiasGradArgs a;
  if (!float_dtype(grad.element_type(), &a.in_dtype) || !float_dtype(out->element_type(), &a.out_dtype))
    return dtype_error("grouped_bias_grad");
  if (!index_array(group_sizes, &a.group_sizes) || !index_array(group_offset, &a.group_offset))
    return dtype_error("group_sizes/group_offset");
  const auto gd = grad.dimensions(), od = out->dimensions();
  if (gd.size() != 2 || od.size() != 2) return invalid("bad operand rank");
  a.m = gd[0], a.n = gd[1], a.num_groups = od[0];
  if (od[1] != a.n) return shape_error("out");
  a.grad = grad.untyped_data(), a.out = out->untyped_data();
  return to_ffi(grouped_bias_grad(a, context(device, stream, &*workspace)));
}

// The gradients of a matmul from one core call. An unwanted gradient's result is a size-0
// placeholder and reaches the core as null.
ffi::Error matmul_backward(Device device, void* stream, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                           ffi::AnyBuffer grad, ffi::AnyBuffer group_sizes, ffi::AnyBuffer group_offset,
                           ffi::Result<ffi::AnyBuffer> dlhs, ffi::Result<ffi::AnyBuffer> drhs,
                           ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace,
                           bool transpose_rhs, bool want_dlhs, bool want_drhs, bool want_dbias) {
  BackwardArgs a;
  if (!float_dtype(lhs.element_type(), &a.in_dtype) || !float_dtype(drhs->element_type(), &a.drhs_dtype) ||
      !float_dtype(dbias->element_type(), &a.dbias_dtype))
    return dtype_error("grouped_matmul_backward");
  if (!index_array(group_sizes, &a.group_sizes) || !index_array(group_offset, &a.group_offset))
    return dtype_error("group_sizes/group_offset");
  const auto ld = lhs.dimensions(), rd = rhs.dimensions();
  if (ld.size() != 2 || rd.size() != 3) return invalid("bad operand rank");
  a.m = ld[0], a.k = ld[1], a.num_groups = rd[0], a.n = transpose_rhs ? rd[1] : rd[2];
  if ((transpose_rhs ? rd[2] : rd[1]) != a.k || rhs.element_type() != lhs.element_type())
    return shape_error("rhs");
  if (!shape_is(grad, {a.m, a.n}) || grad.element_type() != lhs.element_type()) return shape_error("grad");
  if (want_dlhs && (!shape_is(*dlhs, {a.m, a.k}) || dlhs->element_type() != lhs.element_type()))
    return shape_error("dlhs");
  if (want_drhs && !shape_is(*drhs, {rd[0], rd[1], rd[2]})) return shape_error("drhs");
  if (want_dbias && !shape_is(*dbias, {a.num_groups, a.n})) return shape_error("dbias");
  a.lhs = lhs.untyped_data(), a.rhs = rhs.untyped_data(), a.grad = grad.untyped_data();
  a.dlhs = want_dlhs ? dlhs->untyped_data() : nullptr;
  a.drhs = want_drhs ? drhs->untyped_data() : nullptr;
  a.dbias = want_dbias ? dbias->untyped_data() : nullptr;
  a.transpose_rhs = transpose_rhs;
  return to_ffi(grouped_matmul_backward(a, context(device, stream, &*workspace)));
}

// Bindings: operands, results, attributes. The CUDA variants add the stream context.
auto matmul_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<bool>("transpose_rhs")
      .Attr<bool>("has_bias");
}
auto wgrad_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<bool>("accumulate");
}
auto bias_grad_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>();
}

auto matmul_backward_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>()
      .Attr<bool>("transpose_rhs")
      .Attr<bool>("want_dlhs")
      .Attr<bool>("want_drhs")
      .Attr<bool>("want_dbias");
}

template <typename... Rest>
ffi::Error matmul_cpu(Rest... rest) {
  return matmul(Device::cpu, nullptr, rest...);
}
template <typename... Rest>
ffi::Error matmul_cuda(void* stream, Rest... rest) {
  return matmul(Device::cuda, stream, rest...);
}
template <typename... Rest>
ffi::Error wgrad_cpu(Rest... rest) {
  return wgrad(Device::cpu, nullptr, rest...);
}
template <typename... Rest>
ffi::Error wgrad_cuda(void* stream, Rest... rest) {
  return wgrad(Device::cuda, stream, rest...);
}
template <typename... Rest>
ffi::Error bias_grad_cpu(Rest... rest) {
  return bias_grad(Device::cpu, nullptr, rest...);
}
template <typename... Rest>
ffi::Error bias_grad_cuda(void* stream, Rest... rest) {
  return bias_grad(Device::cuda, stream, rest...);
}

template <typename... Rest>
ffi::Error matmul_backward_cpu(Rest... rest) {
  return matmul_backward(Device::cpu, nullptr, rest...);
}
template <typename... Rest>
ffi::Error matmul_backward_cuda(void* stream, Rest... rest) {
  return matmul_backward(Device::cuda, stream, rest...);
}

using Buf = ffi::AnyBuffer;
using Out = ffi::Result<ffi::AnyBuffer>;

XLA_FFI_DEFINE_HANDLER(kMatmulCpu, (matmul_cpu<Buf, Buf, Buf, Buf, Buf, Out, Out, bool, bool>),
                       matmul_binding());
XLA_FFI_DEFINE_HANDLER(kMatmulCuda, (matmul_cuda<Buf, Buf, Buf, Buf, Buf, Out, Out, bool, bool>),
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<void*>>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Ret<Buf>()
                           .Ret<Buf>()
                           .Attr<bool>("transpose_rhs")
                           .Attr<bool>("has_bias"),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kWgradCpu, (wgrad_cpu<Buf, Buf, Buf, Buf, Buf, Out, Out, bool>), wgrad_binding());
XLA_FFI_DEFINE_HANDLER(kWgradCuda, (wgrad_cuda<Buf, Buf, Buf, Buf, Buf, Out, Out, bool>),
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<void*>>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Ret<Buf>()
                           .Ret<Buf>()
                           .Attr<bool>("accumulate"),
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kBiasGradCpu, (bias_grad_cpu<Buf, Buf, Buf, Out, Out>), bias_grad_binding());
XLA_FFI_DEFINE_HANDLER(
    kBiasGradCuda, (bias_grad_cuda<Buf, Buf, Buf, Out, Out>),
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>().Arg<Buf>().Arg<Buf>().Arg<Buf>().Ret<Buf>().Ret<Buf>(),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kMatmulBackwardCpu,
                       (matmul_backward_cpu<Buf, Buf, Buf, Buf, Buf, Out, Out, Out, Out, bool, bool, bool, bool>),
                       matmul_backward_binding());
XLA_FFI_DEFINE_HANDLER(kMatmulBackwardCuda,
                       (matmul_backward_cuda<Buf, Buf, Buf, Buf, Buf, Out, Out, Out, Out, bool, bool, bool, bool>),
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<void*>>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Arg<Buf>()
                           .Ret<Buf>()
                           .Ret<Buf>()
                           .Ret<Buf>()
                           .Ret<Buf>()
                           .Attr<bool>("transpose_rhs")
                           .Attr<bool>("want_dlhs")
                           .Attr<bool>("want_drhs")
                           .Attr<bool>("want_dbias"),
                       {ffi::Traits::kCmdBufferCompatible});

nb::capsule capsule(XLA_FFI_Handler* fn) { return nb::capsule(reinterpret_cast<void*>(fn)); }

}  // namespace

void bind_ffi_handlers(nb::module_& m) {
  m.def(
      "ffi_handlers",
      [] {
        nb::dict cpu, cuda;
        cpu["groupgemm_matmul"] = capsule(kMatmulCpu);
        cpu["groupgemm_wgrad"] = capsule(kWgradCpu);
        cpu["groupgemm_bias_grad"] = capsule(kBiasGradCpu);
        cpu["groupgemm_matmul_backward"] = capsule(kMatmulBackwardCpu);
        cuda["groupgemm_matmul"] = capsule(kMatmulCuda);
        cuda["groupgemm_wgrad"] = capsule(kWgradCuda);
        cuda["groupgemm_bias_grad"] = capsule(kBiasGradCuda);
        cuda["groupgemm_matmul_backward"] = capsule(kMatmulBackwardCuda);
        add_moe_ffi_handlers(cpu, cuda);
        nb::dict out;
        out["cpu"] = cpu;
        out["CUDA"] = cuda;
        return out;
      },
      "XLA FFI handler capsules by platform, then target name.");
}

}  // namespace groupgemm
