// The XLA FFI handlers: every op of the table (python/csrc/op_table.h) as an XLA FFI target
// on the CPU and on CUDA. An XLA call passes the op's operands and results in their declared
// order (a size-0 rank-1 placeholder for an absent optional one) and its attributes by name
// (flags as bool, integers as int64), read with the FFI calls of the oldest supported jax.
// The CUDA variant runs on XLA's stream and is declared command-buffer compatible: the core
// reads group sizes on the device and allocates nothing (workspaces are extra results). A
// refused argument is XLA's invalid-argument error, naming it.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "arg_view.h"
#include "dtype_table.h"
#include "op_table.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace groupgemm {
namespace {

using glue::ArgView;

// The attributes of the call being decoded, straight from XLA's call frame, for naming one
// the op does not declare: the FFI headers of the oldest supported jax, which the wheel
// builds against, cannot list a Dictionary's names.
thread_local const XLA_FFI_Attrs* call_attributes = nullptr;

std::string declared_list(const glue::Op& op) {
  std::string declared;
  for (const glue::Param& p : op.attributes) declared += (declared.empty() ? "" : ", ") + p.name;
  return declared.empty() ? "none" : declared;
}

std::string undeclared_list(const glue::Op& op) {
  std::string undeclared;
  for (int64_t i = 0; call_attributes && i < call_attributes->size; ++i) {
    const std::string name(call_attributes->names[i]->ptr, call_attributes->names[i]->len);
    if (!op.find(op.attributes, name)) undeclared += (undeclared.empty() ? "" : ", ") + name;
  }
  return undeclared;
}

glue::Element element_of(ffi::DataType t, DType* dtype) {
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

ArgView view(const ffi::AnyBuffer& b, const char* name) {
  ArgView v;
  v.name = name, v.data = b.untyped_data(), v.element = element_of(b.element_type(), &v.dtype);
  const auto dims = b.dimensions();
  if (dims.size() > static_cast<size_t>(ArgView::kMaxRank)) glue::refuse(v, "has too many dimensions");
  v.rank = static_cast<int>(dims.size());
  for (int i = 0; i < v.rank; ++i) v.dims[i] = dims[i];
  return v;
}

class FfiCall : public glue::OpCall {
 public:
  FfiCall(const glue::Op& op, ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs)
      : OpCall(op), args_(args), rets_(rets), attrs_(attrs) {
    if (static_cast<int>(args.size()) != op.num_operands || static_cast<int>(rets.size()) != op.num_results)
      throw glue::ArgError(std::string(op.target) + " takes " + std::to_string(op.num_operands) +
                               " operands and " + std::to_string(op.num_results) + " results",
                           false);
    size_t declared_given = 0;
    for (const glue::Param& p : op.attributes) {
      if (attrs.contains(p.name))
        ++declared_given;
      else if (!p.optional)
        throw glue::ArgError(p.name + " must be given", false);
    }
    if (declared_given != attrs.size())  // an attribute the op does not declare
      throw glue::ArgError(std::string(op.target) + " does not take the attribute " + undeclared_list(op) +
                               " (its attributes: " + declared_list(op) + ")",
                           false);
  }

  ffi::AnyBuffer buffer(const glue::Param& p) const {
    if (p.result) {
      auto result = rets_.get<ffi::AnyBuffer>(p.index);
      if (!result.has_value()) throw glue::ArgError(p.name + " must be a buffer", true);
      return **result;
    }
    auto operand = args_.get<ffi::AnyBuffer>(p.index);
    if (!operand.has_value()) throw glue::ArgError(p.name + " must be a buffer", true);
    return *operand;
  }

  using OpCall::array;
  ArgView array(const glue::Param& p) const override {
    const ArgView v = view(buffer(p), p.name.c_str());
    if (p.optional && v.rank == 1 && v.dims[0] == 0) return ArgView{p.name.c_str()};  // a placeholder
    return v;
  }

  // Flags are bools, integers int64.
  std::optional<int64_t> attribute(const char* name, bool is_flag) const override {
    const std::string& key = op.attribute(name).name;
    if (!attrs_.contains(key)) return std::nullopt;
    if (is_flag) {
      if (const auto v = attrs_.get<bool>(key); v.has_value()) return *v;
    } else if (const auto v = attrs_.get<int64_t>(key); v.has_value()) {
      return *v;
    }
    throw glue::ArgError(key + (is_flag ? " must be a bool" : " must be an int64"), true);
  }

 private:
  ffi::RemainingArgs args_;
  ffi::RemainingRets rets_;
  ffi::Dictionary attrs_;
};

ffi::Error run(size_t index, Device device, void* stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
               ffi::Dictionary attrs) {
  const glue::Op& op = glue::ops()[index];
  try {
    FfiCall call(op, args, rets, attrs);
    call.context.device = device, call.context.stream = stream;
    if (const glue::Param* w = op.find(op.arrays, "workspace")) {
      const ffi::AnyBuffer workspace = call.buffer(*w);
      call.context.workspace = workspace.untyped_data();
      call.context.workspace_bytes = static_cast<int64_t>(workspace.size_bytes());
    }
    const Status s = op.run(call);
    if (s.ok()) return ffi::Error::Success();
    const auto code = s.code == Status::Code::invalid_argument ? ffi::ErrorCode::kInvalidArgument
                      : s.code == Status::Code::unimplemented  ? ffi::ErrorCode::kUnimplemented
                                                               : ffi::ErrorCode::kInternal;
    return ffi::Error(code, "groupgemm: " + s.message);
  } catch (const glue::ArgError& e) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string("groupgemm: ") + e.what());
  }
}

// An XLA handler has no state of its own: one pair per table index, bound once.
template <size_t I>
XLA_FFI_Error* cpu_handler(XLA_FFI_CallFrame* frame) {
  static auto* bound = ffi::Ffi::Bind()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attrs()
                           .To([](ffi::RemainingArgs a, ffi::RemainingRets r, ffi::Dictionary d) {
                             return run(I, Device::cpu, nullptr, a, r, d);
                           })
                           .release();
  call_attributes = &frame->attrs;
  return bound->Call(frame);
}

template <size_t I>
XLA_FFI_Error* cuda_handler(XLA_FFI_CallFrame* frame) {
  static auto* bound = ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<void*>>()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attrs()
                           .To([](void* stream, ffi::RemainingArgs a, ffi::RemainingRets r,
                                  ffi::Dictionary d) { return run(I, Device::cuda, stream, a, r, d); },
                               {ffi::Traits::kCmdBufferCompatible})
                           .release();
  call_attributes = &frame->attrs;
  return bound->Call(frame);
}

constexpr size_t kMaxOps = 32;

template <size_t... I>
std::pair<XLA_FFI_Handler*, XLA_FFI_Handler*> handlers(size_t index, std::index_sequence<I...>) {
  static constexpr XLA_FFI_Handler* cpu[] = {&cpu_handler<I>...};
  static constexpr XLA_FFI_Handler* cuda[] = {&cuda_handler<I>...};
  return {cpu[index], cuda[index]};
}

}  // namespace

// The capsules of every op's target by platform, then target name, which groupgemm.jax
// registers at import.
void bind_ffi_handlers(nb::module_& m) {
  m.def(
      "ffi_handlers",
      [] {
        if (glue::ops().size() > kMaxOps) throw std::logic_error("raise kMaxOps to the number of ops");
        nb::dict cpu, cuda, out;
        for (size_t i = 0; i < glue::ops().size(); ++i) {
          const auto [on_cpu, on_cuda] = handlers(i, std::make_index_sequence<kMaxOps>());
          cpu[glue::ops()[i].target] = nb::capsule(reinterpret_cast<void*>(on_cpu));
          cuda[glue::ops()[i].target] = nb::capsule(reinterpret_cast<void*>(on_cuda));
        }
        out["cpu"] = cpu, out["CUDA"] = cuda;
        return out;
      },
      "XLA FFI handler capsules by platform, then target name.");
}

}  // namespace groupgemm
