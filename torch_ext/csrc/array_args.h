// The array entry points' side of the bindings: DLPack arrays (torch tensors, NumPy
// arrays) as ArgViews (python/csrc/arg_view.h), all of one call on one device, and a core
// call run without the GIL with its Status raised as a Python exception (the array entry
// points, array_bindings.cpp, and the call plans, call_plans.cpp). A refused argument
// (glue::ArgError) is raised as TypeError or ValueError by the translator module.cpp
// registers.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "arg_view.h"
#include "dtype_table.h"
#include "groupgemm/groupgemm.h"

namespace groupgemm {
namespace array_args {

namespace nb = nanobind;

// Any C-contiguous array, read-only ones included (an op's operands may be; its results are
// checked to be writable where they are taken).
using Array = nb::ndarray<nb::ro, nb::c_contig>;
using WritableArray = nb::ndarray<nb::c_contig>;
using glue::ArgView;

inline glue::Element element_of(nb::dlpack::dtype t, DType* dtype) {
  using Code = nb::dlpack::dtype_code;
  if (const std::optional<DType> d = dtype_from_dlpack(t)) return *dtype = *d, glue::Element::floating;
  if (t.lanes != 1) return glue::Element::other;
  if (t.code == static_cast<uint8_t>(Code::Int) && (t.bits == 32 || t.bits == 64))
    return t.bits == 32 ? glue::Element::int32 : glue::Element::int64;
  if (t.code == static_cast<uint8_t>(Code::UInt) && t.bits == 8) return glue::Element::uint8;
  return glue::Element::other;
}

// The views of one call's arrays. All live on one device (add() checks each as it comes);
// that device and the stream make the call's context.
class ArrayViews {
 public:
  void add(const std::optional<Array>& a, const char* name) {
    if (a) add_device(*a, name);
  }
  // A view of `a`; given() false when it is None.
  ArgView operator()(const std::optional<Array>& a, const char* name) const {
    ArgView v;
    v.name = name;
    if (!a) return v;
    v.data = const_cast<void*>(a->data()), v.element = element_of(a->dtype(), &v.dtype);
    if (a->ndim() > static_cast<size_t>(ArgView::kMaxRank))
      throw nb::value_error((std::string(name) + " has too many dimensions").c_str());
    v.rank = static_cast<int>(a->ndim());
    for (int i = 0; i < v.rank; ++i) v.dims[i] = static_cast<int64_t>(a->shape(i));
    return v;
  }
  // The caller-allocated scratch the CUDA backend writes its per-call setup into.
  void set_workspace(const std::optional<Array>& workspace) {
    if (!workspace) return;
    add_device(*workspace, "workspace");
    ctx_.workspace = const_cast<void*>(workspace->data());
    ctx_.workspace_bytes = static_cast<int64_t>(workspace->nbytes());
  }
  void set_stream(uintptr_t stream) { ctx_.stream = reinterpret_cast<void*>(stream); }
  const ExecContext& context() const { return ctx_; }

 private:
  void add_device(const Array& a, const char* name) {
    const int type = a.device_type(), id = a.device_id();
    if (type != nb::device::cpu::value && type != nb::device::cuda::value)
      throw nb::value_error((std::string(name) + " must be on the CPU or a CUDA device").c_str());
    if (!first_name_.empty()) {
      if (type != type_ || (type == nb::device::cuda::value && id != id_))
        throw nb::value_error((std::string(name) + " is on a different device than " + first_name_).c_str());
      return;
    }
    type_ = type, id_ = id, first_name_ = name;
    ctx_.device = type == nb::device::cuda::value ? Device::cuda : Device::cpu;
    ctx_.device_index = type == nb::device::cuda::value ? id : -1;
  }

  ExecContext ctx_;
  int type_ = 0, id_ = 0;
  std::string first_name_;
};

// Runs `call` (a core call, returning its Status) without the GIL (other Python threads
// keep going) and turns its status into ValueError (bad argument), NotImplementedError (a
// backend this build lacks; a RuntimeError subclass) or RuntimeError.
template <typename Call>
void run_core(Call call) {
  Status s;
  {
    nb::gil_scoped_release release;
    s = call();
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
