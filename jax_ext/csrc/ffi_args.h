// The XLA FFI handlers' side of the bindings, one style for every op.
//
// An op is one function, `ffi::Error op(Device, void* stream, operands..., results...,
// attributes...)`: it makes ArgViews (python/csrc/arg_view.h) of its buffers, unpacks them
// with the code the array entry points share (gemm_args.h, expert_args.h, fp8_args.h) and
// calls the core. Everything else is generated from that signature: XLA's binding
// (ffi::Ffi::BindTo reads operands, results and named attributes off the parameter types),
// the CPU variant (no stream) and the CUDA one (XLA's stream, declared command-buffer
// compatible: the core reads group sizes on the device and allocates nothing; workspaces
// are extra results), a refused argument as XLA's invalid-argument error, and the
// target's entry in the capsule dicts groupgemm.jax registers (GROUPGEMM_FFI_TARGET, one
// line beside the op).
#pragma once

#include <nanobind/nanobind.h>

#include <optional>
#include <string>
#include <vector>

#include "arg_view.h"
#include "dtype_table.h"
#include "groupgemm/groupgemm.h"
#include "xla/ffi/api/ffi.h"

namespace groupgemm {
namespace ffi_args {

namespace ffi = xla::ffi;
namespace nb = nanobind;

using Buf = ffi::AnyBuffer;
using Out = ffi::Result<ffi::AnyBuffer>;
using glue::ArgView;
// A named attribute: `Attribute<bool, kHasBias> has_bias`, read as *has_bias.
template <typename T, const char* name>
using Attribute = ffi::Attr<T, name>;

inline glue::Element element_of(ffi::DataType t, DType* dtype) {
  if (const std::optional<DType> d = dtype_from_xla(t)) return *dtype = *d, glue::Element::floating;
  switch (t) {
    case ffi::DataType::S32: return glue::Element::int32;
    case ffi::DataType::S64: return glue::Element::int64;
    case ffi::DataType::U8: return glue::Element::uint8;
    case ffi::DataType::F8E4M3FN: return glue::Element::float8_e4m3;
    case ffi::DataType::F8E5M2: return glue::Element::float8_e5m2;
    default: return glue::Element::other;
  }
}

inline ArgView view(const Buf& b, const char* name) {
  ArgView v;
  v.name = name, v.data = b.untyped_data(), v.element = element_of(b.element_type(), &v.dtype);
  const auto dims = b.dimensions();
  if (dims.size() > static_cast<size_t>(ArgView::kMaxRank)) glue::refuse(v, "has too many dimensions");
  v.rank = static_cast<int>(dims.size());
  for (int i = 0; i < v.rank; ++i) v.dims[i] = dims[i];
  return v;
}
inline ArgView view(Out& b, const char* name) { return view(*b, name); }

// An optional operand or result: XLA passes a size-0 placeholder when it is not `given`.
template <typename B>
ArgView optional(B& b, const char* name, bool given) {
  if (given) return view(b, name);
  ArgView v;
  v.name = name;
  return v;
}

inline ExecContext context(Device device, void* stream) {
  ExecContext ctx;
  ctx.device = device, ctx.stream = stream;
  return ctx;
}
inline ExecContext context(Device device, void* stream, Out& workspace) {
  ExecContext ctx = context(device, stream);
  ctx.workspace = workspace->untyped_data();
  ctx.workspace_bytes = static_cast<int64_t>(workspace->size_bytes());
  return ctx;
}

inline ffi::Error to_ffi(const Status& s) {
  if (s.ok()) return ffi::Error::Success();
  const auto code = s.code == Status::Code::invalid_argument ? ffi::ErrorCode::kInvalidArgument
                    : s.code == Status::Code::unimplemented  ? ffi::ErrorCode::kUnimplemented
                                                             : ffi::ErrorCode::kInternal;
  return ffi::Error(code, "groupgemm: " + s.message);
}

// XLA's stream, the first parameter of an op's CUDA variant.
struct Stream {
  Stream(void* stream) : ptr(stream) {}  // NOLINT: decoded from PlatformStream<void*>
  void* ptr;
};

}  // namespace ffi_args
}  // namespace groupgemm

template <>
struct xla::ffi::CtxBinding<groupgemm::ffi_args::Stream> {
  using Ctx = PlatformStream<void*>;
};

namespace groupgemm {
namespace ffi_args {

template <typename Run>
ffi::Error refusing_bad_arguments(Run run) {
  try {
    return run();
  } catch (const glue::ArgError& e) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string("groupgemm: ") + e.what());
  }
}

// The CPU and CUDA variants of an op.
template <auto Op>
struct Platforms;
template <typename... P, ffi::Error (*Op)(Device, void*, P...)>
struct Platforms<Op> {
  static ffi::Error cpu(P... p) {
    return refusing_bad_arguments([&] { return Op(Device::cpu, nullptr, p...); });
  }
  static ffi::Error cuda(Stream stream, P... p) {
    return refusing_bad_arguments([&] { return Op(Device::cuda, stream.ptr, p...); });
  }
};

template <auto Variant, bool kOnCuda>
XLA_FFI_Error* handler(XLA_FFI_CallFrame* call_frame) {
  static auto* bound = [] {
    if constexpr (kOnCuda)
      return ffi::Ffi::BindTo(Variant, {ffi::Traits::kCmdBufferCompatible}).release();
    else
      return ffi::Ffi::BindTo(Variant).release();
  }();
  return bound->Call(call_frame);
}

// Every target, registered beside its op's definition (GROUPGEMM_FFI_TARGET) into the list
// of its module function (`listed_by`: "ffi_handlers", "fp8_ffi_handlers").
struct Target {
  const char* listed_by;
  const char* name;
  XLA_FFI_Handler* cpu;
  XLA_FFI_Handler* cuda;
};

inline std::vector<Target>& targets() {
  static std::vector<Target> all;  // filled while the module loads, read once it has
  return all;
}

struct TargetRegistration {
  explicit TargetRegistration(Target t) { targets().push_back(t); }
};

template <auto Op>
Target target(const char* listed_by, const char* name) {
  return {listed_by, name, &handler<&Platforms<Op>::cpu, false>, &handler<&Platforms<Op>::cuda, true>};
}

#define GROUPGEMM_FFI_TARGET(listed_by, name, op)                    \
  const ::groupgemm::ffi_args::TargetRegistration op##_registration( \
      ::groupgemm::ffi_args::target<op>(listed_by, name))

// `listed_by()`, a function of the module: the capsules of its targets by platform, then
// target name, as groupgemm.jax registers them.
inline void def_targets(nb::module_& m, const char* listed_by, const char* doc) {
  const std::string list = listed_by;
  m.def(
      listed_by,
      [list] {
        nb::dict cpu, cuda, out;
        for (const Target& t : targets()) {
          if (list != t.listed_by) continue;
          cpu[t.name] = nb::capsule(reinterpret_cast<void*>(t.cpu));
          cuda[t.name] = nb::capsule(reinterpret_cast<void*>(t.cuda));
        }
        out["cpu"] = cpu, out["CUDA"] = cuda;
        return out;
      },
      doc);
}

}  // namespace ffi_args
}  // namespace groupgemm
