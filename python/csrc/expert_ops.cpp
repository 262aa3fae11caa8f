// The expert layer's entry points (op_table.h): permute, unpermute and its backward, the
// activation and its backward, the router's softmax top-k, its backward and its tangent.
#include "arg_view.h"
#include "groupgemm/activation.h"
#include "groupgemm/groupgemm.h"
#include "op_table.h"

namespace groupgemm {
namespace {

using namespace glue;

// probs and dprobs: the values' dtype, or float32.
DType probs_dtype(const ArgView& v, DType values) {
  const DType t = float_dtype(v);
  if (t != values && t != DType::f32)
    refuse(v,
           std::string("must be ") + dtype_name(values) + (values == DType::f32 ? "" : " or float32") +
               ", got " + dtype_name(t),
           true);
  return t;
}

// The router's probabilities (probs, dprobs, tprobs): float32, float64 for float64 logits.
void expect_router_probs(const ArgView& v, DType logits) {
  expect_dtype(v, logits == DType::f64 ? DType::f64 : DType::f32, "the router's probabilities");
}

GROUPGEMM_OP(
    permute, "groupgemm_permute", "tokens expert_indices", "permuted group_sizes row_map workspace?", "",
    "Groups token rows by expert (stable; dropped slots last as zero rows); writes permuted [T*k, H], "
    "group_sizes [E] and row_map [T, k] (int32, -1 for a dropped slot).") {
  PermuteArgs a;
  const ArgView tokens = call.array("tokens"), expert_indices = call.array("expert_indices"),
                permuted = call.array("permuted"), group_sizes = call.array("group_sizes"),
                row_map = call.array("row_map");
  expect_rank(tokens, 2), expect_rank(expert_indices, 2), expect_rank(group_sizes, 1);
  a.num_tokens = tokens.dims[0], a.hidden = tokens.dims[1];
  a.top_k = expert_indices.dims[1], a.num_experts = group_sizes.dims[0];
  expect_dim(expert_indices, 0, a.num_tokens);
  expect_shape(permuted, {a.num_tokens * a.top_k, a.hidden});
  expect_shape(row_map, {a.num_tokens, a.top_k});
  a.dtype = float_dtype(tokens);
  expect_dtype(permuted, a.dtype, "tokens");
  a.tokens = tokens.data, a.permuted = permuted.data;
  a.expert_indices = index_array(expert_indices);
  a.group_sizes = int32_data(group_sizes), a.row_map = int32_data(row_map);
  return permute(a, call.context);
}

GROUPGEMM_OP(
    unpermute, "groupgemm_unpermute", "permuted row_map probs?", "out", "",
    "out[t] = sum over j in order of probs[t, j] * permuted[row_map[t, j]] (float32 accumulation).") {
  UnpermuteArgs a;
  const ArgView permuted = call.array("permuted"), row_map = call.array("row_map"),
                probs = call.array("probs"), out = call.array("out");
  expect_rank(permuted, 2), expect_rank(row_map, 2);
  a.num_rows = permuted.dims[0], a.hidden = permuted.dims[1];
  a.num_tokens = row_map.dims[0], a.top_k = row_map.dims[1];
  expect_shape(out, {a.num_tokens, a.hidden});
  a.dtype = float_dtype(permuted);
  expect_dtype(out, a.dtype, "permuted");
  if (probs.given()) {
    expect_shape(probs, {a.num_tokens, a.top_k});
    a.probs_dtype = probs_dtype(probs, a.dtype), a.probs = probs.data;
  }
  a.permuted = permuted.data, a.out = out.data, a.row_map = int32_data(row_map);
  return unpermute(a, call.context);
}

// permuted is read for dprobs only.
GROUPGEMM_OP(unpermute_backward, "groupgemm_unpermute_backward", "dout permuted? row_map probs?",
             "dpermuted? dprobs? workspace?", "",
             "Each output that is given: dpermuted[r] = the sum over the slots (t, j) naming row r, in slot "
             "order, of probs[t, j] * dout[t] (rows no slot names 0); dprobs[t, j] = "
             "dot(permuted[row_map[t, j]], dout[t]).") {
  UnpermuteBackwardArgs a;
  const ArgView dout = call.array("dout"), permuted = call.array("permuted"), row_map = call.array("row_map"),
                probs = call.array("probs"), dpermuted = call.array("dpermuted"),
                dprobs = call.array("dprobs");
  expect_rank(dout, 2), expect_rank(row_map, 2);
  a.num_tokens = row_map.dims[0], a.top_k = row_map.dims[1], a.hidden = dout.dims[1];
  expect_dim(dout, 0, a.num_tokens);
  a.dtype = float_dtype(dout);
  if (dprobs.given() && !permuted.given()) refuse(permuted, "must be given for dprobs");
  const ArgView& rows = permuted.given() ? permuted : dpermuted;  // R: permuted's rows, else dpermuted's
  if (rows.given()) expect_rank(rows, 2), a.num_rows = rows.dims[0];
  for (const ArgView* v : {&permuted, &dpermuted}) {
    if (!v->given()) continue;
    expect_shape(*v, {a.num_rows, a.hidden});
    expect_dtype(*v, a.dtype, "dout");
  }
  a.permuted = permuted.data, a.dpermuted = dpermuted.data;
  for (const ArgView* v : {&probs, &dprobs})
    if (v->given()) expect_shape(*v, {a.num_tokens, a.top_k});
  if (probs.given()) a.probs_dtype = probs_dtype(probs, a.dtype), a.probs = probs.data;
  if (dprobs.given()) {
    if (probs.given())
      expect_dtype(dprobs, a.probs_dtype, "probs");
    else
      a.probs_dtype = probs_dtype(dprobs, a.dtype);
    a.dprobs = dprobs.data;
  }
  a.dout = dout.data, a.row_map = int32_data(row_map);
  return unpermute_backward(a, call.context);
}

// The width of the activation's output, once the core can take h's: an odd swiglu width is
// the core's to report, in its words.
bool activation_width(Activation kind, int64_t in_features, int64_t* out_features) {
  if (kind == Activation::swiglu && in_features % 2 != 0) return false;
  *out_features = activation_out_features(kind, in_features);
  return true;
}

// kind is Activation's value (attribute_enums.h).
GROUPGEMM_OP(activation, "groupgemm_activation", "h", "out", "kind",
             "out = act(h); swiglu takes [M, 2F] (gate first) to [M, F].") {
  ActivationArgs a;
  const ArgView h = call.array("h"), out = call.array("out");
  expect_rank(h, 2);
  a.kind = *call.enumerated<Activation>("kind"), a.rows = h.dims[0], a.in_features = h.dims[1];
  a.dtype = float_dtype(h);
  int64_t out_features;
  if (activation_width(a.kind, a.in_features, &out_features)) expect_shape(out, {a.rows, out_features});
  expect_dtype(out, a.dtype, "h");
  a.h = h.data, a.out = out.data;
  return activation(a, call.context);
}

GROUPGEMM_OP(activation_backward, "groupgemm_activation_backward", "dout h", "dh", "kind",
             "dh = act'(h) * dout, the exact derivative.") {
  ActivationBackwardArgs a;
  const ArgView dout = call.array("dout"), h = call.array("h"), dh = call.array("dh");
  expect_rank(h, 2);
  a.kind = *call.enumerated<Activation>("kind"), a.rows = h.dims[0], a.in_features = h.dims[1];
  a.dtype = float_dtype(h);
  int64_t out_features;
  if (activation_width(a.kind, a.in_features, &out_features)) expect_shape(dout, {a.rows, out_features});
  expect_shape(dh, {a.rows, a.in_features});
  expect_dtype(dout, a.dtype, "h"), expect_dtype(dh, a.dtype, "h");
  a.dout = dout.data, a.h = h.data, a.dh = dh.data;
  return activation_backward(a, call.context);
}

// logits [T, E] and expert_indices [T, k], the router's common pair.
template <typename Args>
void set_router(Args& a, const OpCall& call) {
  const ArgView logits = call.array("logits"), expert_indices = call.array("expert_indices");
  expect_rank(logits, 2), expect_rank(expert_indices, 2);
  a.num_tokens = logits.dims[0], a.num_experts = logits.dims[1], a.top_k = expert_indices.dims[1];
  expect_dim(expert_indices, 0, a.num_tokens);
  a.dtype = float_dtype(logits), a.renormalize = call.flag("renormalize");
  a.logits = logits.data, a.expert_indices = int32_data(expert_indices);
}

GROUPGEMM_OP(softmax_topk, "groupgemm_softmax_topk", "logits", "expert_indices probs", "renormalize",
             "Each token's k largest logits (ties: lower expert first; -inf and NaN never chosen, -1 for an "
             "empty slot) and their softmax probabilities, renormalized over the chosen ones or not.") {
  SoftmaxTopkArgs a;
  set_router(a, call);
  const ArgView probs = call.array("probs");
  expect_shape(probs, {a.num_tokens, a.top_k});
  expect_router_probs(probs, a.dtype);
  a.probs = probs.data;
  return softmax_topk(a, call.context);
}

GROUPGEMM_OP(softmax_topk_backward, "groupgemm_softmax_topk_backward", "logits expert_indices dprobs",
             "dlogits", "renormalize", "dlogits from dprobs, through softmax_topk's choices.") {
  SoftmaxTopkBackwardArgs a;
  set_router(a, call);
  const ArgView dprobs = call.array("dprobs"), dlogits = call.array("dlogits");
  expect_shape(dprobs, {a.num_tokens, a.top_k});
  expect_router_probs(dprobs, a.dtype);
  expect_shape(dlogits, {a.num_tokens, a.num_experts});
  expect_dtype(dlogits, a.dtype, "logits");
  a.dprobs = dprobs.data, a.dlogits = dlogits.data;
  return softmax_topk_backward(a, call.context);
}

GROUPGEMM_OP(softmax_topk_tangent, "groupgemm_softmax_topk_tangent", "logits expert_indices tlogits",
             "tprobs", "renormalize",
             "tprobs, the tangent of softmax_topk's probabilities for the logits' tangent tlogits (forward "
             "mode).") {
  SoftmaxTopkTangentArgs a;
  set_router(a, call);
  const ArgView tlogits = call.array("tlogits"), tprobs = call.array("tprobs");
  expect_shape(tlogits, {a.num_tokens, a.num_experts});
  expect_dtype(tlogits, a.dtype, "logits");
  expect_shape(tprobs, {a.num_tokens, a.top_k});
  expect_router_probs(tprobs, a.dtype);
  a.tlogits = tlogits.data, a.tprobs = tprobs.data;
  return softmax_topk_tangent(a, call.context);
}

}  // namespace
}  // namespace groupgemm
