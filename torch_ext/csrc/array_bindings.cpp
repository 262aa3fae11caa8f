// Array entry points of groupgemm._core: DLPack-capable arrays (torch tensors, NumPy
// arrays) reach the core zero-copy. Every array argument is .noconvert() and C-contiguous,
// so a wrong dtype, layout or device raises instead of being silently copied (a copied
// output would be lost).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "dtype_table.h"
#include "groupgemm/groupgemm.h"

namespace nb = nanobind;

namespace groupgemm {
namespace {

using Array = nb::ndarray<nb::c_contig>;

DType float_dtype(const Array& a, const char* name) {
  if (const std::optional<DType> t = dtype_from_dlpack(a.dtype())) return *t;
  throw nb::type_error((std::string(name) + " must be " + accepted_dtype_names()).c_str());
}

IndexArray index_array(const Array& a, const char* name) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes != 1 || t.code != static_cast<uint8_t>(nb::dlpack::dtype_code::Int) ||
      (t.bits != 32 && t.bits != 64))
    throw nb::type_error((std::string(name) + " must be int32 or int64").c_str());
  return {a.data(), t.bits == 32 ? IndexType::i32 : IndexType::i64, static_cast<int64_t>(a.size())};
}

void expect_rank(const Array& a, size_t rank, const char* name) {
  if (a.ndim() != rank)
    throw nb::value_error(
        (std::string(name) + " must have rank " + std::to_string(rank) + ", got " + std::to_string(a.ndim()))
            .c_str());
}

void expect_dim(const Array& a, size_t axis, int64_t want, const char* name) {
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

IndexArray optional_offset(const std::optional<Array>& offset, ContextBuilder& devices) {
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

void grouped_matmul_array(Array lhs, Array rhs, Array group_sizes, Array out, std::optional<Array> bias,
                          std::optional<Array> group_offset, bool transpose_rhs,
                          std::optional<Array> workspace, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&lhs, "lhs"}, {&rhs, "rhs"}, {&group_sizes, "group_sizes"}, {&out, "out"}})
    devices.add(*a, name);
  expect_rank(lhs, 2, "lhs"), expect_rank(rhs, 3, "rhs"), expect_rank(out, 2, "out");
  expect_rank(group_sizes, 1, "group_sizes");
  MatmulArgs a;
  a.m = lhs.shape(0), a.k = lhs.shape(1), a.num_groups = rhs.shape(0);
  a.n = rhs.shape(transpose_rhs ? 1 : 2);
  expect_dim(rhs, transpose_rhs ? 2 : 1, a.k, "rhs");
  expect_dim(out, 0, a.m, "out"), expect_dim(out, 1, a.n, "out");
  a.in_dtype = float_dtype(lhs, "lhs"), a.out_dtype = float_dtype(out, "out");
  if (float_dtype(rhs, "rhs") != a.in_dtype) throw nb::type_error("rhs must have the dtype of lhs");
  if (bias) {
    devices.add(*bias, "bias");
    expect_rank(*bias, 2, "bias"), expect_dim(*bias, 0, a.num_groups, "bias"),
        expect_dim(*bias, 1, a.n, "bias");
    if (float_dtype(*bias, "bias") != a.in_dtype) throw nb::type_error("bias must have the dtype of lhs");
    a.bias = bias->data();
  }
  a.lhs = lhs.data(), a.rhs = rhs.data(), a.out = out.data(), a.transpose_rhs = transpose_rhs;
  a.group_sizes = index_array(group_sizes, "group_sizes");
  a.group_offset = optional_offset(group_offset, devices);
  devices.set_workspace(workspace);
  run_core(grouped_matmul, a, devices.context());
}

void grouped_matmul_wgrad_array(Array lhs, Array grad, Array group_sizes, Array out,
                                std::optional<Array> group_offset, bool accumulate,
                                std::optional<Array> workspace, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] :
       {std::pair{&lhs, "lhs"}, {&grad, "grad"}, {&group_sizes, "group_sizes"}, {&out, "out"}})
    devices.add(*a, name);
  expect_rank(lhs, 2, "lhs"), expect_rank(grad, 2, "grad"), expect_rank(out, 3, "out");
  expect_rank(group_sizes, 1, "group_sizes");
  WgradArgs a;
  a.m = lhs.shape(0), a.k = lhs.shape(1), a.n = grad.shape(1), a.num_groups = out.shape(0);
  expect_dim(grad, 0, a.m, "grad"), expect_dim(out, 1, a.k, "out"), expect_dim(out, 2, a.n, "out");
  a.in_dtype = float_dtype(lhs, "lhs"), a.out_dtype = float_dtype(out, "out");
  if (float_dtype(grad, "grad") != a.in_dtype) throw nb::type_error("grad must have the dtype of lhs");
  a.lhs = lhs.data(), a.grad = grad.data(), a.out = out.data(), a.accumulate = accumulate;
  a.group_sizes = index_array(group_sizes, "group_sizes");
  a.group_offset = optional_offset(group_offset, devices);
  devices.set_workspace(workspace);
  run_core(grouped_matmul_wgrad, a, devices.context());
}

void grouped_bias_grad_array(Array grad, Array group_sizes, Array out, std::optional<Array> group_offset,
                             std::optional<Array> workspace, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&grad, "grad"}, {&group_sizes, "group_sizes"}, {&out, "out"}})
    devices.add(*a, name);
  expect_rank(grad, 2, "grad"), expect_rank(out, 2, "out"), expect_rank(group_sizes, 1, "group_sizes");
  BiasGradArgs a;
  a.m = grad.shape(0), a.n = grad.shape(1), a.num_groups = out.shape(0);
  expect_dim(out, 1, a.n, "out");
  a.in_dtype = float_dtype(grad, "grad"), a.out_dtype = float_dtype(out, "out");
  a.grad = grad.data(), a.out = out.data();
  a.group_sizes = index_array(group_sizes, "group_sizes");
  a.group_offset = optional_offset(group_offset, devices);
  devices.set_workspace(workspace);
  run_core(grouped_bias_grad, a, devices.context());
}

}  // namespace

void bind_array_entry_points(nb::module_& m) {
  m.def("grouped_matmul", &grouped_matmul_array, nb::arg("lhs").noconvert(), nb::arg("rhs").noconvert(),
        nb::arg("group_sizes").noconvert(), nb::arg("out").noconvert(),
        nb::arg("bias").noconvert() = nb::none(), nb::arg("group_offset").noconvert() = nb::none(),
        nb::arg("transpose_rhs") = false, nb::arg("workspace").noconvert() = nb::none(),
        nb::arg("stream") = 0,
        "out[M,N] = lhs[M,K] @ rhs[g] (+ bias[g]) per group; padding rows are written as 0.");
  m.def("grouped_matmul_wgrad", &grouped_matmul_wgrad_array, nb::arg("lhs").noconvert(),
        nb::arg("grad").noconvert(), nb::arg("group_sizes").noconvert(), nb::arg("out").noconvert(),
        nb::arg("group_offset").noconvert() = nb::none(), nb::arg("accumulate") = false,
        nb::arg("workspace").noconvert() = nb::none(), nb::arg("stream") = 0,
        "out[g] = lhs_g^T @ grad_g (or += with accumulate); empty groups give 0 (or stay untouched).");
  m.def("grouped_bias_grad", &grouped_bias_grad_array, nb::arg("grad").noconvert(),
        nb::arg("group_sizes").noconvert(), nb::arg("out").noconvert(),
        nb::arg("group_offset").noconvert() = nb::none(), nb::arg("workspace").noconvert() = nb::none(),
        nb::arg("stream") = 0, "out[g] = sum of grad rows of group g; empty groups give 0.");
}

}  // namespace groupgemm
