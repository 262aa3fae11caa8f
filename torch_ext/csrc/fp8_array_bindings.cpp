// The FP8 array entry points of groupgemm._core (groupgemm/fp8.h), and the FP8 enums and
// sizes both frontends share. float8 operands arrive as uint8 arrays of their bytes (a
// zero-copy torch .view(torch.uint8); every torch version exports uint8 through DLPack)
// with their format named by an Fp8Type argument; scales are float32. Every array
// argument is .noconvert() and C-contiguous, and its shape is checked here, so a call
// can never index past an array.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <optional>
#include <string>

#include "array_args.h"
#include "groupgemm/fp8.h"
#include "groupgemm/fp8_blocks.h"

namespace nb = nanobind;

namespace groupgemm {
namespace {

using namespace array_args;

// The bytes of a float8 array, as uint8.
const void* fp8_bytes(const Array& a, const char* name) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes != 1 || t.code != static_cast<uint8_t>(nb::dlpack::dtype_code::UInt) || t.bits != 8)
    throw nb::type_error((std::string(name) + " must be the uint8 bytes of a float8 array").c_str());
  return a.data();
}

void expect_size(const Array& a, int64_t want, const char* name) {
  if (static_cast<int64_t>(a.size()) != want)
    throw nb::value_error((std::string(name) + " has " + std::to_string(a.size()) + " elements, expected " +
                           std::to_string(want))
                              .c_str());
}

float* scale_array(const Array& a, const char* name, int64_t want) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes != 1 || t.code != static_cast<uint8_t>(nb::dlpack::dtype_code::Float) || t.bits != 32)
    throw nb::type_error((std::string(name) + " must be float32").c_str());
  expect_size(a, want, name);
  return static_cast<float*>(a.data());
}

void quantize_rows_array(Array x, Array q, Array scale, Fp8Type out_type, Fp8Scaling scaling,
                         bool power_of_two, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&x, "x"}, {&q, "q"}, {&scale, "scale"}}) devices.add(*a, name);
  expect_rank(x, 2, "x");
  QuantizeRowsArgs a;
  a.rows = x.shape(0), a.cols = x.shape(1);
  a.in_dtype = float_dtype(x, "x"), a.out_type = out_type, a.scaling = scaling, a.power_of_two = power_of_two;
  expect_size(q, a.rows * a.cols, "q");
  a.x = x.data(), a.q = const_cast<void*>(fp8_bytes(q, "q"));
  a.scale = scale_array(scale, "scale", row_scale_count(scaling, a.rows, a.cols));
  run_core(quantize_rows, a, devices.context());
}

void quantize_blocks_array(Array x, Array q, Array scale, Fp8Type out_type, bool power_of_two,
                           uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&x, "x"}, {&q, "q"}, {&scale, "scale"}}) devices.add(*a, name);
  expect_rank(x, 3, "x");
  QuantizeBlocksArgs a;
  a.batch = x.shape(0), a.rows = x.shape(1), a.cols = x.shape(2);
  a.in_dtype = float_dtype(x, "x"), a.out_type = out_type, a.power_of_two = power_of_two;
  expect_size(q, a.batch * a.rows * a.cols, "q");
  a.x = x.data(), a.q = const_cast<void*>(fp8_bytes(q, "q"));
  a.scale = scale_array(scale, "scale", block_scale_count(a.batch, a.rows, a.cols));
  run_core(quantize_blocks, a, devices.context());
}

void quantize_grouped_array(Array x, Array q, Array scale, Array group_sizes, int64_t num_groups,
                            Fp8Type out_type, Fp8Scaling scaling, bool power_of_two,
                            std::optional<Array> group_offset, std::optional<Array> workspace,
                            uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&x, "x"}, {&q, "q"}, {&scale, "scale"}, {&group_sizes, "group_sizes"}})
    devices.add(*a, name);
  expect_rank(x, 2, "x"), expect_rank(group_sizes, 1, "group_sizes");
  if (num_groups < 0) throw nb::value_error("num_groups must be non-negative");
  QuantizeGroupedArgs a;
  a.m = x.shape(0), a.cols = x.shape(1), a.num_groups = num_groups;
  a.in_dtype = float_dtype(x, "x"), a.out_type = out_type, a.scaling = scaling, a.power_of_two = power_of_two;
  expect_size(q, a.m * a.cols, "q");
  a.x = x.data(), a.q = const_cast<void*>(fp8_bytes(q, "q"));
  a.scale = scale_array(scale, "scale", token_scale_rows(scaling, a.m, num_groups) * a.cols);
  a.group_sizes = index_array(group_sizes, "group_sizes");
  a.group_offset = optional_offset(group_offset, devices);
  devices.set_workspace(workspace);
  run_core(quantize_grouped, a, devices.context());
}

void scaled_grouped_matmul_array(Array lhs, Array rhs, Array lhs_scale, Array rhs_scale, Array group_sizes,
                                 Array out, Fp8Type lhs_type, Fp8Type rhs_type, Fp8Scaling scaling,
                                 std::optional<Array> bias, std::optional<Array> group_offset,
                                 bool group_ends, std::optional<Array> workspace, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&lhs, "lhs"},
                         {&rhs, "rhs"},
                         {&lhs_scale, "lhs_scale"},
                         {&rhs_scale, "rhs_scale"},
                         {&group_sizes, "group_sizes"},
                         {&out, "out"}})
    devices.add(*a, name);
  expect_rank(lhs, 2, "lhs"), expect_rank(rhs, 3, "rhs"), expect_rank(out, 2, "out");
  expect_rank(group_sizes, 1, "group_sizes");
  ScaledMatmulArgs a;
  a.m = lhs.shape(0), a.k = lhs.shape(1), a.num_groups = rhs.shape(0), a.n = rhs.shape(1);
  expect_dim(rhs, 2, a.k, "rhs"), expect_dim(out, 0, a.m, "out"), expect_dim(out, 1, a.n, "out");
  a.lhs_type = lhs_type, a.rhs_type = rhs_type, a.scaling = scaling, a.out_dtype = float_dtype(out, "out");
  a.lhs = fp8_bytes(lhs, "lhs"), a.rhs = fp8_bytes(rhs, "rhs"), a.out = out.data();
  a.lhs_scale = scale_array(lhs_scale, "lhs_scale", row_scale_count(scaling, a.m, a.k));
  a.rhs_scale = scale_array(rhs_scale, "rhs_scale", weight_scale_count(scaling, a.num_groups, a.n, a.k));
  if (bias) {
    devices.add(*bias, "bias");
    expect_rank(*bias, 2, "bias"), expect_dim(*bias, 0, a.num_groups, "bias"),
        expect_dim(*bias, 1, a.n, "bias");
    if (float_dtype(*bias, "bias") != a.out_dtype) throw nb::type_error("bias must have the output's dtype");
    a.bias = bias->data();
  }
  a.group_sizes = index_array(group_sizes, "group_sizes", group_ends);
  a.group_offset = optional_offset(group_offset, devices);
  devices.set_workspace(workspace);
  run_core(scaled_grouped_matmul, a, devices.context());
}

void scaled_grouped_matmul_wgrad_array(Array lhs, Array rhs, Array lhs_scale, Array rhs_scale,
                                       Array group_sizes, Array out, Fp8Type lhs_type, Fp8Type rhs_type,
                                       Fp8Scaling scaling, std::optional<Array> group_offset, bool accumulate,
                                       bool group_ends, std::optional<Array> workspace, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&lhs, "lhs"},
                         {&rhs, "rhs"},
                         {&lhs_scale, "lhs_scale"},
                         {&rhs_scale, "rhs_scale"},
                         {&group_sizes, "group_sizes"},
                         {&out, "out"}})
    devices.add(*a, name);
  expect_rank(lhs, 2, "lhs"), expect_rank(rhs, 2, "rhs"), expect_rank(out, 3, "out");
  expect_rank(group_sizes, 1, "group_sizes");
  ScaledWgradArgs a;
  a.k = lhs.shape(0), a.m = lhs.shape(1), a.n = rhs.shape(0), a.num_groups = out.shape(0);
  expect_dim(rhs, 1, a.m, "rhs"), expect_dim(out, 1, a.k, "out"), expect_dim(out, 2, a.n, "out");
  a.lhs_type = lhs_type, a.rhs_type = rhs_type, a.scaling = scaling, a.out_dtype = float_dtype(out, "out");
  a.accumulate = accumulate;
  a.lhs = fp8_bytes(lhs, "lhs"), a.rhs = fp8_bytes(rhs, "rhs"), a.out = out.data();
  const int64_t scale_rows = token_scale_rows(scaling, a.m, a.num_groups);
  a.lhs_scale = scale_array(lhs_scale, "lhs_scale", scale_rows * a.k);
  a.rhs_scale = scale_array(rhs_scale, "rhs_scale", scale_rows * a.n);
  a.group_sizes = index_array(group_sizes, "group_sizes", group_ends);
  a.group_offset = optional_offset(group_offset, devices);
  devices.set_workspace(workspace);
  run_core(scaled_grouped_matmul_wgrad, a, devices.context());
}

}  // namespace

void bind_fp8_array_entry_points(nb::module_& m) {
  nb::enum_<Fp8Type>(m, "Fp8Type", nb::is_arithmetic(), "A float8 format.")
      .value("e4m3", Fp8Type::e4m3, "float8_e4m3fn")
      .value("e5m2", Fp8Type::e5m2, "float8_e5m2");
  nb::enum_<Fp8Scaling>(m, "Fp8Scaling", nb::is_arithmetic(), "How FP8 scales are laid over an operand.")
      .value("rowwise", Fp8Scaling::rowwise)
      .value("blockwise", Fp8Scaling::blockwise);
  nb::enum_<Fp8Call>(m, "Fp8Call", "An FP8 entry point, for fp8_workspace_bytes.")
      .value("matmul", Fp8Call::matmul)
      .value("wgrad", Fp8Call::wgrad)
      .value("quantize_grouped", Fp8Call::quantize_grouped);
  m.def(
      "fp8_workspace_bytes", &fp8_workspace_bytes, nb::arg("device"), nb::arg("call"), nb::arg("scaling"),
      nb::arg("num_groups"), nb::arg("m"), nb::arg("k"), nb::arg("n"), nb::arg("device_index") = -1,
      "Bytes of workspace an FP8 call needs on `device` (0 on the CPU); (m, k, n) as groupgemm/fp8.h says.");
  m.def("fp8_token_block_bound", &token_block_bound, nb::arg("m"), nb::arg("num_groups"),
        "Scale rows of the blockwise weight gradient: floor((m + 127 G) / 128).");
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
