// The array entry points' shared argument handling: DLPack arrays checked for dtype,
// rank, shape and device, turned into core arguments, and a core call run without the
// GIL with its Status turned into a Python exception. Used by array_bindings.cpp (the
// GEMMs) and moe_array_bindings.cpp (the expert layer's ops).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "dtype_table.h"
#include "groupgemm/groupgemm.h"

namespace groupgemm {
namespace array_args {

namespace nb = nanobind;

using Array = nb::ndarray<nb::c_contig>;

inline DType float_dtype(const Array& a, const char* name) {
  if (const std::optional<DType> t = dtype_from_dlpack(a.dtype())) return *t;
  throw nb::type_error((std::string(name) + " must be " + accepted_dtype_names()).c_str());
}

// cumulative: the array holds cumulative group ends rather than sizes (IndexArray).
inline IndexArray index_array(const Array& a, const char* name, bool cumulative = false) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes != 1 || t.code != static_cast<uint8_t>(nb::dlpack::dtype_code::Int) ||
      (t.bits != 32 && t.bits != 64))
    throw nb::type_error((std::string(name) + " must be int32 or int64").c_str());
  return {a.data(), t.bits == 32 ? IndexType::i32 : IndexType::i64, static_cast<int64_t>(a.size()), cumulative};
}

inline void expect_rank(const Array& a, size_t rank, const char* name) {
  if (a.ndim() != rank)
    throw nb::value_error(
        (std::string(name) + " must have rank " + std::to_string(rank) + ", got " + std::to_string(a.ndim()))
            .c_str());
}

inline void expect_dim(const Array& a, size_t axis, int64_t want, const char* name) {
  if (static_cast<int64_t>(a.shape(axis)) != want)
    throw nb::value_error((std::string(name) + " dimension " + std::to_string(axis) + " is " +
                           std::to_string(a.shape(axis)) + ", expected " + std::to_string(want))
                              .c_str());
}

// All arrays of one call live on one device; that device and the stream make the context.
class ContextBuilder {
 public:
  explicit ContextBuilder(uintptr_t stream) { ctx_.stream = reinterpret_cast<void*>(stream); }
  void add(const Array& a, const char* name) {
    const int type = a.device_type();
    const int id = a.device_id();
    if (type != nb::device::cpu::value && type != nb::device::cuda::value)
      throw nb::value_error((std::string(name) + " must be on the CPU or a CUDA device").c_str());
    if (!first_) {
      if (type != type_ || (type == nb::device::cuda::value && id != id_))
        throw nb::value_error((std::string(name) + " is on a different device than " + first_name_).c_str());
      return;
    }
    first_ = false, type_ = type, id_ = id, first_name_ = name;
    ctx_.device = type == nb::device::cuda::value ? Device::cuda : Device::cpu;
    ctx_.device_index = type == nb::device::cuda::value ? id : -1;
  }
  // The caller-allocated scratch the CUDA backend writes its per-group setup into.
  void set_workspace(const std::optional<Array>& workspace) {
    if (!workspace) return;
    add(*workspace, "workspace");
    ctx_.workspace = workspace->data();
    ctx_.workspace_bytes = static_cast<int64_t>(workspace->nbytes());
  }
  const ExecContext& context() const { return ctx_; }

 private:
  ExecContext ctx_;
  bool first_ = true;
  int type_ = 0, id_ = 0;
  std::string first_name_;
};

inline IndexArray optional_offset(const std::optional<Array>& offset, ContextBuilder& devices) {
  if (!offset) return {};
  if (offset->size() != 1) throw nb::value_error("group_offset must be a scalar");
  devices.add(*offset, "group_offset");
  return index_array(*offset, "group_offset");
}

// Runs a core entry point without the GIL (other Python threads keep going) and turns
// its status into ValueError (bad argument), NotImplementedError (a backend this build
// lacks; a RuntimeError subclass) or RuntimeError.
template <typename Args, typename Fn>
void run_core(Fn fn, const Args& args, const ExecContext& ctx) {
  Status s;
  {
    nb::gil_scoped_release release;
    s = fn(args, ctx);
  }
  if (s.ok()) return;
  if (s.code == Status::Code::invalid_argument) throw nb::value_error(s.message.c_str());
  if (s.code == Status::Code::unimplemented) {
    PyErr_SetString(PyExc_NotImplementedError, s.message.c_str());
    throw nb::python_error();
  }
  throw std::runtime_error(s.message);
}

}  // namespace array_args
}  // namespace groupgemm
