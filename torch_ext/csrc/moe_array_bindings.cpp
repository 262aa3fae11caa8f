// Array entry points of the expert layer's ops (permute, unpermute and its backward, the
// activation and its backward, the router's softmax top-k, its backward and its tangent),
// with the GEMM entry points' rules: every array is .noconvert() and C-contiguous, all on
// one device, shapes checked here with the argument's name, the core call run without the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>
#include <string>

#include "array_args.h"
#include "groupgemm/activation.h"
#include "groupgemm/groupgemm.h"

namespace nb = nanobind;

namespace groupgemm {
namespace {

using namespace array_args;

int64_t dim(const Array& a, size_t axis) { return static_cast<int64_t>(a.shape(axis)); }

// row_map and group_sizes: int32 arrays the core writes or reads as such.
const int32_t* int32_data(const Array& a, const char* name) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes != 1 || t.code != static_cast<uint8_t>(nb::dlpack::dtype_code::Int) || t.bits != 32)
    throw nb::type_error((std::string(name) + " must be int32").c_str());
  return static_cast<const int32_t*>(a.data());
}

void expect_dtype(const Array& a, DType want, const char* name, const char* of) {
  if (float_dtype(a, name) != want)
    throw nb::type_error(
        (std::string(name) + " must have the dtype of " + of + " (" + dtype_name(want) + ")").c_str());
}

// probs (and dprobs): the values' dtype or float32.
DType probs_dtype(const Array& probs, DType values, const char* name) {
  const DType t = float_dtype(probs, name);
  if (t != values && t != DType::f32)
    throw nb::type_error((std::string(name) + " must be " + dtype_name(values) +
                          (values == DType::f32 ? "" : " or float32") + ", got " + dtype_name(t))
                             .c_str());
  return t;
}

void check_activation_kind(Activation kind, int64_t in_features) {
  if (kind == Activation::swiglu && in_features % 2 != 0)
    throw nb::value_error(
        ("h has " + std::to_string(in_features) + " columns; swiglu needs an even count (gate and up halves)")
            .c_str());
}

void permute_array(Array tokens, Array expert_indices, Array permuted, Array group_sizes, Array row_map,
                   std::optional<Array> workspace, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&tokens, "tokens"},
                         {&expert_indices, "expert_indices"},
                         {&permuted, "permuted"},
                         {&group_sizes, "group_sizes"},
                         {&row_map, "row_map"}})
    devices.add(*a, name);
  expect_rank(tokens, 2, "tokens"), expect_rank(expert_indices, 2, "expert_indices");
  expect_rank(permuted, 2, "permuted"), expect_rank(group_sizes, 1, "group_sizes");
  expect_rank(row_map, 2, "row_map");
  PermuteArgs a;
  a.num_tokens = dim(tokens, 0), a.hidden = dim(tokens, 1);
  a.top_k = dim(expert_indices, 1), a.num_experts = dim(group_sizes, 0);
  expect_dim(expert_indices, 0, a.num_tokens, "expert_indices");
  expect_dim(permuted, 0, a.num_tokens * a.top_k, "permuted"), expect_dim(permuted, 1, a.hidden, "permuted");
  expect_dim(row_map, 0, a.num_tokens, "row_map"), expect_dim(row_map, 1, a.top_k, "row_map");
  a.dtype = float_dtype(tokens, "tokens");
  expect_dtype(permuted, a.dtype, "permuted", "tokens");
  a.tokens = tokens.data(), a.permuted = permuted.data();
  a.expert_indices = index_array(expert_indices, "expert_indices");
  a.group_sizes = const_cast<int32_t*>(int32_data(group_sizes, "group_sizes"));
  a.row_map = const_cast<int32_t*>(int32_data(row_map, "row_map"));
  devices.set_workspace(workspace);
  run_core(groupgemm::permute, a, devices.context());
}

void unpermute_array(Array permuted, Array row_map, Array out, std::optional<Array> probs, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&permuted, "permuted"}, {&row_map, "row_map"}, {&out, "out"}})
    devices.add(*a, name);
  expect_rank(permuted, 2, "permuted"), expect_rank(row_map, 2, "row_map"), expect_rank(out, 2, "out");
  UnpermuteArgs a;
  a.num_rows = dim(permuted, 0), a.hidden = dim(permuted, 1);
  a.num_tokens = dim(row_map, 0), a.top_k = dim(row_map, 1);
  expect_dim(out, 0, a.num_tokens, "out"), expect_dim(out, 1, a.hidden, "out");
  a.dtype = float_dtype(permuted, "permuted");
  expect_dtype(out, a.dtype, "out", "permuted");
  if (probs) {
    devices.add(*probs, "probs");
    expect_rank(*probs, 2, "probs");
    expect_dim(*probs, 0, a.num_tokens, "probs"), expect_dim(*probs, 1, a.top_k, "probs");
    a.probs_dtype = probs_dtype(*probs, a.dtype, "probs");
    a.probs = probs->data();
  }
  a.permuted = permuted.data(), a.out = out.data();
  a.row_map = int32_data(row_map, "row_map");
  run_core(groupgemm::unpermute, a, devices.context());
}

void unpermute_backward_array(Array dout, Array permuted, Array row_map, std::optional<Array> dpermuted,
                              std::optional<Array> probs, std::optional<Array> dprobs,
                              std::optional<Array> workspace, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&dout, "dout"}, {&permuted, "permuted"}, {&row_map, "row_map"}})
    devices.add(*a, name);
  expect_rank(dout, 2, "dout"), expect_rank(permuted, 2, "permuted"), expect_rank(row_map, 2, "row_map");
  UnpermuteBackwardArgs a;
  a.num_rows = dim(permuted, 0), a.hidden = dim(permuted, 1);
  a.num_tokens = dim(row_map, 0), a.top_k = dim(row_map, 1);
  expect_dim(dout, 0, a.num_tokens, "dout"), expect_dim(dout, 1, a.hidden, "dout");
  a.dtype = float_dtype(permuted, "permuted");
  expect_dtype(dout, a.dtype, "dout", "permuted");
  if (dpermuted) {
    devices.add(*dpermuted, "dpermuted");
    expect_rank(*dpermuted, 2, "dpermuted");
    expect_dim(*dpermuted, 0, a.num_rows, "dpermuted"), expect_dim(*dpermuted, 1, a.hidden, "dpermuted");
    expect_dtype(*dpermuted, a.dtype, "dpermuted", "permuted");
    a.dpermuted = dpermuted->data();
  }
  for (auto [p, name] : {std::pair{&probs, "probs"}, {&dprobs, "dprobs"}}) {
    if (!*p) continue;
    devices.add(**p, name);
    expect_rank(**p, 2, name);
    expect_dim(**p, 0, a.num_tokens, name), expect_dim(**p, 1, a.top_k, name);
  }
  if (probs) a.probs_dtype = probs_dtype(*probs, a.dtype, "probs"), a.probs = probs->data();
  if (dprobs) {
    if (probs)
      expect_dtype(*dprobs, a.probs_dtype, "dprobs", "probs");
    else
      a.probs_dtype = probs_dtype(*dprobs, a.dtype, "dprobs");
    a.dprobs = dprobs->data();
  }
  a.dout = dout.data(), a.permuted = permuted.data();
  a.row_map = int32_data(row_map, "row_map");
  devices.set_workspace(workspace);
  run_core(groupgemm::unpermute_backward, a, devices.context());
}

void activation_array(Array h, Array out, Activation kind, uintptr_t stream) {
  ContextBuilder devices(stream);
  devices.add(h, "h"), devices.add(out, "out");
  expect_rank(h, 2, "h"), expect_rank(out, 2, "out");
  ActivationArgs a;
  a.kind = kind, a.rows = dim(h, 0), a.in_features = dim(h, 1);
  check_activation_kind(kind, a.in_features);
  expect_dim(out, 0, a.rows, "out"), expect_dim(out, 1, activation_out_features(kind, a.in_features), "out");
  a.dtype = float_dtype(h, "h");
  expect_dtype(out, a.dtype, "out", "h");
  a.h = h.data(), a.out = out.data();
  run_core(groupgemm::activation, a, devices.context());
}

void activation_backward_array(Array dout, Array h, Array dh, Activation kind, uintptr_t stream) {
  ContextBuilder devices(stream);
  devices.add(dout, "dout"), devices.add(h, "h"), devices.add(dh, "dh");
  expect_rank(dout, 2, "dout"), expect_rank(h, 2, "h"), expect_rank(dh, 2, "dh");
  ActivationBackwardArgs a;
  a.kind = kind, a.rows = dim(h, 0), a.in_features = dim(h, 1);
  check_activation_kind(kind, a.in_features);
  expect_dim(dout, 0, a.rows, "dout"),
      expect_dim(dout, 1, activation_out_features(kind, a.in_features), "dout");
  expect_dim(dh, 0, a.rows, "dh"), expect_dim(dh, 1, a.in_features, "dh");
  a.dtype = float_dtype(h, "h");
  expect_dtype(dout, a.dtype, "dout", "h"), expect_dtype(dh, a.dtype, "dh", "h");
  a.dout = dout.data(), a.h = h.data(), a.dh = dh.data();
  run_core(groupgemm::activation_backward, a, devices.context());
}

// probs / dprobs of the router: float32, float64 for float64 logits.
DType router_probs_dtype(DType logits) { return logits == DType::f64 ? DType::f64 : DType::f32; }

void softmax_topk_array(Array logits, Array expert_indices, Array probs, bool renormalize, uintptr_t stream) {
  ContextBuilder devices(stream);
  devices.add(logits, "logits"), devices.add(expert_indices, "expert_indices"), devices.add(probs, "probs");
  expect_rank(logits, 2, "logits"), expect_rank(expert_indices, 2, "expert_indices"),
      expect_rank(probs, 2, "probs");
  SoftmaxTopkArgs a;
  a.num_tokens = dim(logits, 0), a.num_experts = dim(logits, 1), a.top_k = dim(expert_indices, 1);
  a.renormalize = renormalize;
  expect_dim(expert_indices, 0, a.num_tokens, "expert_indices");
  expect_dim(probs, 0, a.num_tokens, "probs"), expect_dim(probs, 1, a.top_k, "probs");
  a.dtype = float_dtype(logits, "logits");
  expect_dtype(probs, router_probs_dtype(a.dtype), "probs", "the router's probabilities");
  a.logits = logits.data(), a.probs = probs.data();
  a.expert_indices = const_cast<int32_t*>(int32_data(expert_indices, "expert_indices"));
  run_core(groupgemm::softmax_topk, a, devices.context());
}

void softmax_topk_backward_array(Array logits, Array expert_indices, Array dprobs, Array dlogits,
                                 bool renormalize, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&logits, "logits"},
                         {&expert_indices, "expert_indices"},
                         {&dprobs, "dprobs"},
                         {&dlogits, "dlogits"}})
    devices.add(*a, name), expect_rank(*a, 2, name);
  SoftmaxTopkBackwardArgs a;
  a.num_tokens = dim(logits, 0), a.num_experts = dim(logits, 1), a.top_k = dim(expert_indices, 1);
  a.renormalize = renormalize;
  expect_dim(expert_indices, 0, a.num_tokens, "expert_indices");
  expect_dim(dprobs, 0, a.num_tokens, "dprobs"), expect_dim(dprobs, 1, a.top_k, "dprobs");
  expect_dim(dlogits, 0, a.num_tokens, "dlogits"), expect_dim(dlogits, 1, a.num_experts, "dlogits");
  a.dtype = float_dtype(logits, "logits");
  expect_dtype(dprobs, router_probs_dtype(a.dtype), "dprobs", "the router's probabilities");
  expect_dtype(dlogits, a.dtype, "dlogits", "logits");
  a.logits = logits.data(), a.dprobs = dprobs.data(), a.dlogits = dlogits.data();
  a.expert_indices = int32_data(expert_indices, "expert_indices");
  run_core(groupgemm::softmax_topk_backward, a, devices.context());
}

void softmax_topk_tangent_array(Array logits, Array expert_indices, Array tlogits, Array tprobs,
                                bool renormalize, uintptr_t stream) {
  ContextBuilder devices(stream);
  for (auto [a, name] : {std::pair{&logits, "logits"},
                         {&expert_indices, "expert_indices"},
                         {&tlogits, "tlogits"},
                         {&tprobs, "tprobs"}})
    devices.add(*a, name), expect_rank(*a, 2, name);
  SoftmaxTopkTangentArgs a;
  a.num_tokens = dim(logits, 0), a.num_experts = dim(logits, 1), a.top_k = dim(expert_indices, 1);
  a.renormalize = renormalize;
  expect_dim(expert_indices, 0, a.num_tokens, "expert_indices");
  expect_dim(tlogits, 0, a.num_tokens, "tlogits"), expect_dim(tlogits, 1, a.num_experts, "tlogits");
  expect_dim(tprobs, 0, a.num_tokens, "tprobs"), expect_dim(tprobs, 1, a.top_k, "tprobs");
  a.dtype = float_dtype(logits, "logits");
  expect_dtype(tlogits, a.dtype, "tlogits", "logits");
  expect_dtype(tprobs, router_probs_dtype(a.dtype), "tprobs", "the router's probabilities");
  a.logits = logits.data(), a.tlogits = tlogits.data(), a.tprobs = tprobs.data();
  a.expert_indices = int32_data(expert_indices, "expert_indices");
  run_core(groupgemm::softmax_topk_tangent, a, devices.context());
}

}  // namespace

void bind_moe_array_entry_points(nb::module_& m) {
  m.def("permute", &permute_array, nb::arg("tokens").noconvert(), nb::arg("expert_indices").noconvert(),
        nb::arg("permuted").noconvert(), nb::arg("group_sizes").noconvert(), nb::arg("row_map").noconvert(),
        nb::arg("workspace").noconvert() = nb::none(), nb::arg("stream") = 0,
        "Groups token rows by expert (stable; dropped slots last as zero rows); writes permuted [T*k, H], "
        "group_sizes [E] and row_map [T, k] (int32, -1 for a dropped slot).");
  m.def("unpermute", &unpermute_array, nb::arg("permuted").noconvert(), nb::arg("row_map").noconvert(),
        nb::arg("out").noconvert(), nb::arg("probs").noconvert() = nb::none(), nb::arg("stream") = 0,
        "out[t] = sum over j in order of probs[t, j] * permuted[row_map[t, j]] (float32 accumulation).");
  m.def("unpermute_backward", &unpermute_backward_array, nb::arg("dout").noconvert(),
        nb::arg("permuted").noconvert(), nb::arg("row_map").noconvert(),
        nb::arg("dpermuted").noconvert() = nb::none(), nb::arg("probs").noconvert() = nb::none(),
        nb::arg("dprobs").noconvert() = nb::none(), nb::arg("workspace").noconvert() = nb::none(),
        nb::arg("stream") = 0,
        "Each output that is given: dpermuted[r] = the sum over the slots (t, j) naming row r, in slot "
        "order, of probs[t, j] * dout[t] (rows no slot names 0); dprobs[t, j] = "
        "dot(permuted[row_map[t, j]], dout[t]).");
  m.def("activation", &activation_array, nb::arg("h").noconvert(), nb::arg("out").noconvert(),
        nb::arg("kind"), nb::arg("stream") = 0, "out = act(h); swiglu takes [M, 2F] (gate first) to [M, F].");
  m.def("activation_backward", &activation_backward_array, nb::arg("dout").noconvert(),
        nb::arg("h").noconvert(), nb::arg("dh").noconvert(), nb::arg("kind"), nb::arg("stream") = 0,
        "dh = act'(h) * dout, the exact derivative.");
  m.def("softmax_topk", &softmax_topk_array, nb::arg("logits").noconvert(),
        nb::arg("expert_indices").noconvert(), nb::arg("probs").noconvert(), nb::arg("renormalize"),
        nb::arg("stream") = 0,
        "Each token's k largest logits (ties: lower expert first; -inf and NaN never chosen, -1 for an "
        "empty slot) and their softmax probabilities, renormalized over the chosen ones or not.");
  m.def("softmax_topk_backward", &softmax_topk_backward_array, nb::arg("logits").noconvert(),
        nb::arg("expert_indices").noconvert(), nb::arg("dprobs").noconvert(), nb::arg("dlogits").noconvert(),
        nb::arg("renormalize"), nb::arg("stream") = 0,
        "dlogits from dprobs, through softmax_topk's choices.");
  m.def(
      "softmax_topk_tangent", &softmax_topk_tangent_array, nb::arg("logits").noconvert(),
      nb::arg("expert_indices").noconvert(), nb::arg("tlogits").noconvert(), nb::arg("tprobs").noconvert(),
      nb::arg("renormalize"), nb::arg("stream") = 0,
      "tprobs, the tangent of softmax_topk's probabilities for the logits' tangent tlogits (forward mode).");
}

}  // namespace groupgemm
