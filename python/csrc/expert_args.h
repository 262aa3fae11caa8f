// The expert layer's ops' arguments from their views (arg_view.h), for both bindings:
// permute, unpermute and its backward, the activation and its backward, the router's
// softmax top-k, its backward and its tangent.
#pragma once

#include "arg_view.h"
#include "groupgemm/activation.h"

namespace groupgemm {
namespace glue {

// probs and dprobs: the values' dtype, or float32.
inline DType probs_dtype(const ArgView& v, DType values) {
  const DType t = float_dtype(v);
  if (t != values && t != DType::f32)
    refuse(v,
           std::string("must be ") + dtype_name(values) + (values == DType::f32 ? "" : " or float32") +
               ", got " + dtype_name(t),
           true);
  return t;
}

// The router's probabilities (probs, dprobs, tprobs): float32, float64 for float64 logits.
inline void expect_router_probs(const ArgView& v, DType logits) {
  expect_dtype(v, logits == DType::f64 ? DType::f64 : DType::f32, "the router's probabilities");
}

// tokens [T, H], expert_indices [T, k] -> permuted [T * k, H], group_sizes [E], row_map [T, k].
inline PermuteArgs permute_args(const ArgView& tokens, const ArgView& expert_indices, const ArgView& permuted,
                                const ArgView& group_sizes, const ArgView& row_map) {
  PermuteArgs a;
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
  return a;
}

// permuted [R, H], row_map [T, k], probs [T, k] (optional) -> out [T, H].
inline UnpermuteArgs unpermute_args(const ArgView& permuted, const ArgView& row_map, const ArgView& probs,
                                    const ArgView& out) {
  UnpermuteArgs a;
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
  return a;
}

// unpermute's backward: dout [T, H], row_map [T, k], probs (optional), and permuted [R, H]
// (needed for dprobs) -> each of dpermuted [R, H] and dprobs [T, k] that is given.
inline UnpermuteBackwardArgs unpermute_backward_args(const ArgView& dout, const ArgView& permuted,
                                                     const ArgView& row_map, const ArgView& probs,
                                                     const ArgView& dpermuted, const ArgView& dprobs) {
  UnpermuteBackwardArgs a;
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
  return a;
}

// The width of the activation's output, once the core can take h's: an unknown kind or an
// odd swiglu width is the core's to report, in its words.
inline bool activation_width(Activation kind, int64_t in_features, int64_t* out_features) {
  if (!valid_activation(kind) || (kind == Activation::swiglu && in_features % 2 != 0)) return false;
  *out_features = activation_out_features(kind, in_features);
  return true;
}

// h [M, F_in] -> out [M, F].
inline ActivationArgs activation_args(const ArgView& h, const ArgView& out, Activation kind) {
  ActivationArgs a;
  expect_rank(h, 2);
  a.kind = kind, a.rows = h.dims[0], a.in_features = h.dims[1];
  a.dtype = float_dtype(h);
  int64_t out_features;
  if (activation_width(kind, a.in_features, &out_features)) expect_shape(out, {a.rows, out_features});
  expect_dtype(out, a.dtype, "h");
  a.h = h.data, a.out = out.data;
  return a;
}

// dout [M, F], h [M, F_in] -> dh [M, F_in].
inline ActivationBackwardArgs activation_backward_args(const ArgView& dout, const ArgView& h,
                                                       const ArgView& dh, Activation kind) {
  ActivationBackwardArgs a;
  expect_rank(h, 2);
  a.kind = kind, a.rows = h.dims[0], a.in_features = h.dims[1];
  a.dtype = float_dtype(h);
  int64_t out_features;
  if (activation_width(kind, a.in_features, &out_features)) expect_shape(dout, {a.rows, out_features});
  expect_shape(dh, {a.rows, a.in_features});
  expect_dtype(dout, a.dtype, "h"), expect_dtype(dh, a.dtype, "h");
  a.dout = dout.data, a.h = h.data, a.dh = dh.data;
  return a;
}

// logits [T, E] and expert_indices [T, k], the router's common pair.
template <typename Args>
void set_router(Args& a, const ArgView& logits, const ArgView& expert_indices, bool renormalize) {
  expect_rank(logits, 2), expect_rank(expert_indices, 2);
  a.num_tokens = logits.dims[0], a.num_experts = logits.dims[1], a.top_k = expert_indices.dims[1];
  expect_dim(expert_indices, 0, a.num_tokens);
  a.dtype = float_dtype(logits), a.renormalize = renormalize;
  a.logits = logits.data, a.expert_indices = int32_data(expert_indices);
}

// logits [T, E] -> expert_indices [T, k], probs [T, k].
inline SoftmaxTopkArgs softmax_topk_args(const ArgView& logits, const ArgView& expert_indices,
                                         const ArgView& probs, bool renormalize) {
  SoftmaxTopkArgs a;
  set_router(a, logits, expert_indices, renormalize);
  expect_shape(probs, {a.num_tokens, a.top_k});
  expect_router_probs(probs, a.dtype);
  a.probs = probs.data;
  return a;
}

// logits [T, E], expert_indices [T, k], dprobs [T, k] -> dlogits [T, E].
inline SoftmaxTopkBackwardArgs softmax_topk_backward_args(const ArgView& logits,
                                                          const ArgView& expert_indices,
                                                          const ArgView& dprobs, const ArgView& dlogits,
                                                          bool renormalize) {
  SoftmaxTopkBackwardArgs a;
  set_router(a, logits, expert_indices, renormalize);
  expect_shape(dprobs, {a.num_tokens, a.top_k});
  expect_router_probs(dprobs, a.dtype);
  expect_shape(dlogits, {a.num_tokens, a.num_experts});
  expect_dtype(dlogits, a.dtype, "logits");
  a.dprobs = dprobs.data, a.dlogits = dlogits.data;
  return a;
}

// logits [T, E], expert_indices [T, k], tlogits [T, E] -> tprobs [T, k].
inline SoftmaxTopkTangentArgs softmax_topk_tangent_args(const ArgView& logits, const ArgView& expert_indices,
                                                        const ArgView& tlogits, const ArgView& tprobs,
                                                        bool renormalize) {
  SoftmaxTopkTangentArgs a;
  set_router(a, logits, expert_indices, renormalize);
  expect_shape(tlogits, {a.num_tokens, a.num_experts});
  expect_dtype(tlogits, a.dtype, "logits");
  expect_shape(tprobs, {a.num_tokens, a.top_k});
  expect_router_probs(tprobs, a.dtype);
  a.tlogits = tlogits.data, a.tprobs = tprobs.data;
  return a;
}

}  // namespace glue
}  // namespace groupgemm
