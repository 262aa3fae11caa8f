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

#include "array_args.h"
#include "groupgemm/groupgemm.h"

namespace nb = nanobind;

namespace groupgemm {
namespace {

using namespace array_args;

void grouped_matmul_array(Array lhs, Array rhs, Array group_sizes, Array out, std::optional<Array> bias,
                          std::optional<Array> group_offset, bool transpose_rhs, bool group_ends,
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
  a.group_sizes = index_array(group_sizes, "group_sizes", group_ends);
  a.group_offset = optional_offset(group_offset, devices);
  devices.set_workspace(workspace);
  run_core(grouped_matmul, a, devices.context());
}

void grouped_matmul_wgrad_array(Array lhs, Array grad, Array group_sizes, Array out,
                                std::optional<Array> group_offset, bool accumulate, bool group_ends,
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
  a.group_sizes = index_array(group_sizes, "group_sizes", group_ends);
  a.group_offset = optional_offset(group_offset, devices);
  devices.set_workspace(workspace);
  run_core(grouped_matmul_wgrad, a, devices.context());
}

void grouped_bias_grad_array(Array grad, Array group_sizes, Array out, std::optional<Array> group_offset,
                             bool group_ends, std::optional<Array> workspace, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&grad, "grad"}, {&group_sizes, "group_sizes"}, {&out, "out"}})
    devices.add(*a, name);
  expect_rank(grad, 2, "grad"), expect_rank(out, 2, "out"), expect_rank(group_sizes, 1, "group_sizes");
  BiasGradArgs a;
  a.m = grad.shape(0), a.n = grad.shape(1), a.num_groups = out.shape(0);
  expect_dim(out, 1, a.n, "out");
  a.in_dtype = float_dtype(grad, "grad"), a.out_dtype = float_dtype(out, "out");
  a.grad = grad.data(), a.out = out.data();
  a.group_sizes = index_array(group_sizes, "group_sizes", group_ends);
  a.group_offset = optional_offset(group_offset, devices);
  devices.set_workspace(workspace);
  run_core(grouped_bias_grad, a, devices.context());
}

// Each gradient is given as its output array, or None when it is not wanted.
void grouped_matmul_backward_array(Array lhs, Array rhs, Array grad, Array group_sizes, std::optional<Array> dlhs,
                                   std::optional<Array> drhs, std::optional<Array> dbias,
                                   std::optional<Array> group_offset, bool transpose_rhs, bool accumulate,
                                   bool group_ends, std::optional<Array> workspace, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] :
       {std::pair{&lhs, "lhs"}, {&rhs, "rhs"}, {&grad, "grad"}, {&group_sizes, "group_sizes"}})
    devices.add(*a, name);
  expect_rank(lhs, 2, "lhs"), expect_rank(rhs, 3, "rhs"), expect_rank(grad, 2, "grad");
  expect_rank(group_sizes, 1, "group_sizes");
  BackwardArgs a;
  a.m = lhs.shape(0), a.k = lhs.shape(1), a.num_groups = rhs.shape(0);
  a.n = rhs.shape(transpose_rhs ? 1 : 2);
  expect_dim(rhs, transpose_rhs ? 2 : 1, a.k, "rhs");
  expect_dim(grad, 0, a.m, "grad"), expect_dim(grad, 1, a.n, "grad");
  a.in_dtype = float_dtype(lhs, "lhs");
  if (float_dtype(rhs, "rhs") != a.in_dtype) throw nb::type_error("rhs must have the dtype of lhs");
  if (float_dtype(grad, "grad") != a.in_dtype) throw nb::type_error("grad must have the dtype of lhs");
  if (dlhs) {
    devices.add(*dlhs, "dlhs");
    expect_rank(*dlhs, 2, "dlhs"), expect_dim(*dlhs, 0, a.m, "dlhs"), expect_dim(*dlhs, 1, a.k, "dlhs");
    if (float_dtype(*dlhs, "dlhs") != a.in_dtype) throw nb::type_error("dlhs must have the dtype of lhs");
    a.dlhs = dlhs->data();
  }
  if (drhs) {
    devices.add(*drhs, "drhs");
    expect_rank(*drhs, 3, "drhs");
    for (size_t axis = 0; axis < 3; ++axis) expect_dim(*drhs, axis, rhs.shape(axis), "drhs");
    a.drhs_dtype = float_dtype(*drhs, "drhs"), a.drhs = drhs->data();
  }
  if (dbias) {
    devices.add(*dbias, "dbias");
    expect_rank(*dbias, 2, "dbias"), expect_dim(*dbias, 0, a.num_groups, "dbias"), expect_dim(*dbias, 1, a.n, "dbias");
    a.dbias_dtype = float_dtype(*dbias, "dbias"), a.dbias = dbias->data();
  }
  a.lhs = lhs.data(), a.rhs = rhs.data(), a.grad = grad.data();
  a.transpose_rhs = transpose_rhs, a.accumulate = accumulate;
  a.group_sizes = index_array(group_sizes, "group_sizes", group_ends);
  a.group_offset = optional_offset(group_offset, devices);
  devices.set_workspace(workspace);
  run_core(grouped_matmul_backward, a, devices.context());
}

}  // namespace

void bind_array_entry_points(nb::module_& m) {
  m.def("grouped_matmul", &grouped_matmul_array, nb::arg("lhs").noconvert(), nb::arg("rhs").noconvert(),
        nb::arg("group_sizes").noconvert(), nb::arg("out").noconvert(),
        nb::arg("bias").noconvert() = nb::none(), nb::arg("group_offset").noconvert() = nb::none(),
        nb::arg("transpose_rhs") = false, nb::arg("group_ends") = false,
        nb::arg("workspace").noconvert() = nb::none(), nb::arg("stream") = 0,
        "out[M,N] = lhs[M,K] @ rhs[g] (+ bias[g]) per group; padding rows are written as 0. group_ends: "
        "group_sizes holds cumulative group ends.");
  m.def("grouped_matmul_wgrad", &grouped_matmul_wgrad_array, nb::arg("lhs").noconvert(),
        nb::arg("grad").noconvert(), nb::arg("group_sizes").noconvert(), nb::arg("out").noconvert(),
        nb::arg("group_offset").noconvert() = nb::none(), nb::arg("accumulate") = false,
        nb::arg("group_ends") = false, nb::arg("workspace").noconvert() = nb::none(), nb::arg("stream") = 0,
        "out[g] = lhs_g^T @ grad_g (or += with accumulate); empty groups give 0 (or stay untouched).");
  m.def("grouped_bias_grad", &grouped_bias_grad_array, nb::arg("grad").noconvert(),
        nb::arg("group_sizes").noconvert(), nb::arg("out").noconvert(),
        nb::arg("group_offset").noconvert() = nb::none(), nb::arg("group_ends") = false,
        nb::arg("workspace").noconvert() = nb::none(), nb::arg("stream") = 0,
        "out[g] = sum of grad rows of group g; empty groups give 0.");
  m.def("grouped_matmul_backward", &grouped_matmul_backward_array, nb::arg("lhs").noconvert(),
        nb::arg("rhs").noconvert(), nb::arg("grad").noconvert(), nb::arg("group_sizes").noconvert(),
        nb::arg("dlhs").noconvert() = nb::none(), nb::arg("drhs").noconvert() = nb::none(),
        nb::arg("dbias").noconvert() = nb::none(), nb::arg("group_offset").noconvert() = nb::none(),
        nb::arg("transpose_rhs") = false, nb::arg("accumulate") = false, nb::arg("group_ends") = false,
        nb::arg("workspace").noconvert() = nb::none(), nb::arg("stream") = 0,
        "The gradients of grouped_matmul from one setup: dlhs = grad @ rhs[g]^T, drhs[g] (+)= the weight "
        "gradient in rhs's layout, dbias[g] = sum of group g's grad rows; each None when not wanted.");
}

}  // namespace groupgemm
