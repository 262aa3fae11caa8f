// Array entry points of groupgemm._core: DLPack-capable arrays (torch tensors, NumPy
// arrays) reach the core zero-copy. Every array argument is .noconvert() and C-contiguous,
// so a wrong dtype, layout or device raises instead of being silently copied (a copied
// output would be lost).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <optional>

#include "array_args.h"
#include "gemm_args.h"
#include "groupgemm/groupgemm.h"

namespace nb = nanobind;

namespace groupgemm {
namespace {

using namespace array_args;

void grouped_matmul_array(Array lhs, Array rhs, Array group_sizes, Array out, std::optional<Array> bias,
                          std::optional<Array> group_offset, bool transpose_rhs, bool group_ends,
                          std::optional<Array> workspace, uintptr_t stream) {
  ArrayViews v(stream);
  const MatmulArgs a = glue::matmul_args(v(lhs, "lhs"), v(rhs, "rhs"), v(group_sizes, "group_sizes"),
                                         v(group_offset, "group_offset"), v(bias, "bias"), v(out, "out"),
                                         transpose_rhs, group_ends);
  v.set_workspace(workspace);
  run_core(grouped_matmul, a, v.context());
}

void grouped_matmul_wgrad_array(Array lhs, Array grad, Array group_sizes, Array out,
                                std::optional<Array> group_offset, bool accumulate, bool group_ends,
                                std::optional<Array> workspace, uintptr_t stream) {
  ArrayViews v(stream);
  const WgradArgs a =
      glue::wgrad_args(v(lhs, "lhs"), v(grad, "grad"), v(group_sizes, "group_sizes"),
                       v(group_offset, "group_offset"), v(out, "out"), accumulate, group_ends);
  v.set_workspace(workspace);
  run_core(grouped_matmul_wgrad, a, v.context());
}

void grouped_bias_grad_array(Array grad, Array group_sizes, Array out, std::optional<Array> group_offset,
                             bool group_ends, std::optional<Array> workspace, uintptr_t stream) {
  ArrayViews v(stream);
  const BiasGradArgs a = glue::bias_grad_args(v(grad, "grad"), v(group_sizes, "group_sizes"),
                                              v(group_offset, "group_offset"), v(out, "out"), group_ends);
  v.set_workspace(workspace);
  run_core(grouped_bias_grad, a, v.context());
}

// Each gradient is given as its output array, or None when it is not wanted.
void grouped_matmul_backward_array(Array lhs, Array rhs, Array grad, Array group_sizes,
                                   std::optional<Array> dlhs, std::optional<Array> drhs,
                                   std::optional<Array> dbias, std::optional<Array> group_offset,
                                   bool transpose_rhs, bool accumulate, bool group_ends,
                                   std::optional<Array> workspace, uintptr_t stream) {
  ArrayViews v(stream);
  const BackwardArgs a =
      glue::matmul_backward_args(v(lhs, "lhs"), v(rhs, "rhs"), v(grad, "grad"), v(group_sizes, "group_sizes"),
                                 v(group_offset, "group_offset"), v(dlhs, "dlhs"), v(drhs, "drhs"),
                                 v(dbias, "dbias"), transpose_rhs, accumulate, group_ends);
  v.set_workspace(workspace);
  run_core(grouped_matmul_backward, a, v.context());
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
