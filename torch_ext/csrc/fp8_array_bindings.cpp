// The FP8 array entry points of groupgemm._core (groupgemm/fp8.h). float8 operands arrive
// as uint8 arrays of their bytes (a zero-copy torch .view(torch.uint8); every torch
// version exports uint8 through DLPack) with their format named by an Fp8Type argument;
// scales are float32. Every array argument is .noconvert() and C-contiguous, and is
// unpacked as the XLA FFI handlers unpack theirs (fp8_args.h), so a call can never index
// past an array.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <optional>

#include "array_args.h"
#include "fp8_args.h"
#include "groupgemm/fp8.h"

namespace nb = nanobind;

namespace groupgemm {
namespace {

using namespace array_args;

void quantize_rows_array(Array x, Array q, Array scale, Fp8Type out_type, Fp8Scaling scaling,
                         bool power_of_two, uintptr_t stream) {
  ArrayViews v(stream);
  const QuantizeRowsArgs a =
      glue::quantize_rows_args(v(x, "x"), v(q, "q"), v(scale, "scale"), out_type, scaling, power_of_two);
  run_core(quantize_rows, a, v.context());
}

void quantize_blocks_array(Array x, Array q, Array scale, Fp8Type out_type, bool power_of_two,
                           uintptr_t stream) {
  ArrayViews v(stream);
  const QuantizeBlocksArgs a =
      glue::quantize_blocks_args(v(x, "x"), v(q, "q"), v(scale, "scale"), out_type, power_of_two);
  run_core(quantize_blocks, a, v.context());
}

void quantize_grouped_array(Array x, Array q, Array scale, Array group_sizes, int64_t num_groups,
                            Fp8Type out_type, Fp8Scaling scaling, bool power_of_two,
                            std::optional<Array> group_offset, std::optional<Array> workspace,
                            uintptr_t stream) {
  ArrayViews v(stream);
  const QuantizeGroupedArgs a =
      glue::quantize_grouped_args(v(x, "x"), v(group_sizes, "group_sizes"), v(group_offset, "group_offset"),
                                  v(q, "q"), v(scale, "scale"), num_groups, out_type, scaling, power_of_two);
  v.set_workspace(workspace);
  run_core(quantize_grouped, a, v.context());
}

void scaled_grouped_matmul_array(Array lhs, Array rhs, Array lhs_scale, Array rhs_scale, Array group_sizes,
                                 Array out, Fp8Type lhs_type, Fp8Type rhs_type, Fp8Scaling scaling,
                                 std::optional<Array> bias, std::optional<Array> group_offset,
                                 bool group_ends, std::optional<Array> workspace, uintptr_t stream) {
  ArrayViews v(stream);
  const ScaledMatmulArgs a = glue::scaled_matmul_args(
      v(lhs, "lhs"), v(rhs, "rhs"), v(lhs_scale, "lhs_scale"), v(rhs_scale, "rhs_scale"),
      v(group_sizes, "group_sizes"), v(group_offset, "group_offset"), v(bias, "bias"), v(out, "out"),
      lhs_type, rhs_type, scaling, group_ends);
  v.set_workspace(workspace);
  run_core(scaled_grouped_matmul, a, v.context());
}

void scaled_grouped_matmul_wgrad_array(Array lhs, Array rhs, Array lhs_scale, Array rhs_scale,
                                       Array group_sizes, Array out, Fp8Type lhs_type, Fp8Type rhs_type,
                                       Fp8Scaling scaling, std::optional<Array> group_offset, bool accumulate,
                                       bool group_ends, std::optional<Array> workspace, uintptr_t stream) {
  ArrayViews v(stream);
  const ScaledWgradArgs a = glue::scaled_wgrad_args(v(lhs, "lhs"), v(rhs, "rhs"), v(lhs_scale, "lhs_scale"),
                                                    v(rhs_scale, "rhs_scale"), v(group_sizes, "group_sizes"),
                                                    v(group_offset, "group_offset"), v(out, "out"), lhs_type,
                                                    rhs_type, scaling, accumulate, group_ends);
  v.set_workspace(workspace);
  run_core(scaled_grouped_matmul_wgrad, a, v.context());
}

}  // namespace

void bind_fp8_array_entry_points(nb::module_& m) {
  m.def("fp8_quantize_rows", &quantize_rows_array, nb::arg("x").noconvert(), nb::arg("q").noconvert(),
        nb::arg("scale").noconvert(), nb::arg("out_type"), nb::arg("scaling"),
        nb::arg("power_of_two") = false, nb::arg("stream") = 0,
        "x [R, C] -> q [R, C] float8, scale [R] (rowwise) or [R, ceil(C/128)].");
  m.def("fp8_quantize_blocks", &quantize_blocks_array, nb::arg("x").noconvert(), nb::arg("q").noconvert(),
        nb::arg("scale").noconvert(), nb::arg("out_type"), nb::arg("power_of_two") = false,
        nb::arg("stream") = 0, "x [B, R, C] -> q [B, R, C] float8, scale [B, ceil(R/128), ceil(C/128)].");
  m.def("fp8_quantize_grouped", &quantize_grouped_array, nb::arg("x").noconvert(), nb::arg("q").noconvert(),
        nb::arg("scale").noconvert(), nb::arg("group_sizes").noconvert(), nb::arg("num_groups"),
        nb::arg("out_type"), nb::arg("scaling"), nb::arg("power_of_two") = false,
        nb::arg("group_offset").noconvert() = nb::none(), nb::arg("workspace").noconvert() = nb::none(),
        nb::arg("stream") = 0,
        "x [M, C] -> q [C, M] float8 with scales per (group, channel) or per (token block, channel).");
  m.def("scaled_grouped_matmul", &scaled_grouped_matmul_array, nb::arg("lhs").noconvert(),
        nb::arg("rhs").noconvert(), nb::arg("lhs_scale").noconvert(), nb::arg("rhs_scale").noconvert(),
        nb::arg("group_sizes").noconvert(), nb::arg("out").noconvert(), nb::arg("lhs_type"),
        nb::arg("rhs_type"), nb::arg("scaling"), nb::arg("bias").noconvert() = nb::none(),
        nb::arg("group_offset").noconvert() = nb::none(), nb::arg("group_ends") = false,
        nb::arg("workspace").noconvert() = nb::none(), nb::arg("stream") = 0,
        "out[M, N] = scaled lhs[M, K] @ rhs[g]^T ([G, N, K]) per group (+ bias[g]); padding rows are 0. "
        "group_ends: group_sizes holds cumulative group ends.");
  m.def("scaled_grouped_matmul_wgrad", &scaled_grouped_matmul_wgrad_array, nb::arg("lhs").noconvert(),
        nb::arg("rhs").noconvert(), nb::arg("lhs_scale").noconvert(), nb::arg("rhs_scale").noconvert(),
        nb::arg("group_sizes").noconvert(), nb::arg("out").noconvert(), nb::arg("lhs_type"),
        nb::arg("rhs_type"), nb::arg("scaling"), nb::arg("group_offset").noconvert() = nb::none(),
        nb::arg("accumulate") = false, nb::arg("group_ends") = false,
        nb::arg("workspace").noconvert() = nb::none(), nb::arg("stream") = 0,
        "out[g] (+)= scaled lhs[:, rows_g] @ rhs[:, rows_g]^T (lhs [K, M], rhs [N, M]); empty groups give 0. "
        "group_ends: group_sizes holds cumulative group ends.");
}

}  // namespace groupgemm
