// Array entry points of the expert layer's ops (permute, unpermute and its backward, the
// activation and its backward, the router's softmax top-k, its backward and its tangent),
// with the GEMM entry points' rules: every array is .noconvert() and C-contiguous, all on
// one device, the arguments unpacked as the XLA FFI handlers unpack them (expert_args.h),
// the core call run without the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include <cstdint>
#include <optional>

#include "array_args.h"
#include "expert_args.h"
#include "groupgemm/groupgemm.h"

namespace nb = nanobind;

namespace groupgemm {
namespace {

using namespace array_args;

void permute_array(Array tokens, Array expert_indices, Array permuted, Array group_sizes, Array row_map,
                   std::optional<Array> workspace, uintptr_t stream) {
  ArrayViews v(stream);
  const PermuteArgs a =
      glue::permute_args(v(tokens, "tokens"), v(expert_indices, "expert_indices"), v(permuted, "permuted"),
                         v(group_sizes, "group_sizes"), v(row_map, "row_map"));
  v.set_workspace(workspace);
  run_core(groupgemm::permute, a, v.context());
}

void unpermute_array(Array permuted, Array row_map, Array out, std::optional<Array> probs, uintptr_t stream) {
  ArrayViews v(stream);
  const UnpermuteArgs a =
      glue::unpermute_args(v(permuted, "permuted"), v(row_map, "row_map"), v(probs, "probs"), v(out, "out"));
  run_core(groupgemm::unpermute, a, v.context());
}

void unpermute_backward_array(Array dout, Array permuted, Array row_map, std::optional<Array> dpermuted,
                              std::optional<Array> probs, std::optional<Array> dprobs,
                              std::optional<Array> workspace, uintptr_t stream) {
  ArrayViews v(stream);
  const UnpermuteBackwardArgs a =
      glue::unpermute_backward_args(v(dout, "dout"), v(permuted, "permuted"), v(row_map, "row_map"),
                                    v(probs, "probs"), v(dpermuted, "dpermuted"), v(dprobs, "dprobs"));
  v.set_workspace(workspace);
  run_core(groupgemm::unpermute_backward, a, v.context());
}

void activation_array(Array h, Array out, Activation kind, uintptr_t stream) {
  ArrayViews v(stream);
  const ActivationArgs a = glue::activation_args(v(h, "h"), v(out, "out"), kind);
  run_core(groupgemm::activation, a, v.context());
}

void activation_backward_array(Array dout, Array h, Array dh, Activation kind, uintptr_t stream) {
  ArrayViews v(stream);
  const ActivationBackwardArgs a =
      glue::activation_backward_args(v(dout, "dout"), v(h, "h"), v(dh, "dh"), kind);
  run_core(groupgemm::activation_backward, a, v.context());
}

void softmax_topk_array(Array logits, Array expert_indices, Array probs, bool renormalize, uintptr_t stream) {
  ArrayViews v(stream);
  const SoftmaxTopkArgs a = glue::softmax_topk_args(v(logits, "logits"), v(expert_indices, "expert_indices"),
                                                    v(probs, "probs"), renormalize);
  run_core(groupgemm::softmax_topk, a, v.context());
}

void softmax_topk_backward_array(Array logits, Array expert_indices, Array dprobs, Array dlogits,
                                 bool renormalize, uintptr_t stream) {
  ArrayViews v(stream);
  const SoftmaxTopkBackwardArgs a =
      glue::softmax_topk_backward_args(v(logits, "logits"), v(expert_indices, "expert_indices"),
                                       v(dprobs, "dprobs"), v(dlogits, "dlogits"), renormalize);
  run_core(groupgemm::softmax_topk_backward, a, v.context());
}

void softmax_topk_tangent_array(Array logits, Array expert_indices, Array tlogits, Array tprobs,
                                bool renormalize, uintptr_t stream) {
  ArrayViews v(stream);
  const SoftmaxTopkTangentArgs a =
      glue::softmax_topk_tangent_args(v(logits, "logits"), v(expert_indices, "expert_indices"),
                                      v(tlogits, "tlogits"), v(tprobs, "tprobs"), renormalize);
  run_core(groupgemm::softmax_topk_tangent, a, v.context());
}

}  // namespace

void bind_expert_array_entry_points(nb::module_& m) {
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
