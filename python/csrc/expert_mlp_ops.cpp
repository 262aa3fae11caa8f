// The fused expert MLP's entry points (op_table.h): expert_mlp and its backward
// (groupgemm/expert_mlp.h), one core call each.
#include "arg_view.h"
#include "groupgemm/activation.h"
#include "groupgemm/groupgemm.h"
#include "op_table.h"

namespace groupgemm {
namespace {

using namespace glue;

// What the forward and the backward read alike: tokens [T, H], expert_indices [T, k], probs
// [T, k], w_in [E, H, F_in] and w_out [E, F, H] (transpose_rhs: [E, F_in, H], [E, H, F]), b_out
// [E, H], group_offset, and the activation (kind, Activation's value).
template <typename Args>
void set_common(Args& a, const OpCall& call) {
  const ArgView tokens = call.array("tokens"), expert_indices = call.array("expert_indices"),
                probs = call.array("probs"), w_in = call.array("w_in"), w_out = call.array("w_out"),
                b_out = call.array("b_out");
  expect_rank(tokens, 2), expect_rank(expert_indices, 2), expect_rank(w_in, 3), expect_rank(w_out, 3);
  a.activation = *call.enumerated<Activation>("kind"), a.transpose_rhs = call.flag("transpose_rhs");
  a.num_tokens = tokens.dims[0], a.hidden = tokens.dims[1], a.top_k = expert_indices.dims[1];
  a.num_experts = w_in.dims[0], a.in_features = w_in.dims[a.transpose_rhs ? 1 : 2];
  const int64_t e = a.num_experts, h = a.hidden, f_in = a.in_features;
  const int64_t f = activation_out_features(a.activation, f_in);  // an odd swiglu width: the core's to report
  expect_dim(expert_indices, 0, a.num_tokens);
  a.dtype = float_dtype(tokens);
  if (a.transpose_rhs)
    expect_shape(w_in, {e, f_in, h}), expect_shape(w_out, {e, h, f});
  else
    expect_shape(w_in, {e, h, f_in}), expect_shape(w_out, {e, f, h});
  expect_dtype(w_in, a.dtype, "tokens"), expect_dtype(w_out, a.dtype, "tokens");
  if (probs.given()) {  // tokens' dtype or float32: the core's rule
    expect_shape(probs, {a.num_tokens, a.top_k});
    a.probs_dtype = float_dtype(probs), a.probs = probs.data;
  }
  if (b_out.given())
    expect_shape(b_out, {e, h}), expect_dtype(b_out, a.dtype, "tokens"), a.b_out = b_out.data;
  a.tokens = tokens.data, a.w_in = w_in.data, a.w_out = w_out.data;
  a.expert_indices = index_array(expert_indices);
  a.group_offset = optional_offset(call.array("group_offset"));
}

GROUPGEMM_OP(expert_mlp, "groupgemm_expert_mlp",
             "tokens expert_indices probs? w_in w_out b_in? b_out? group_offset?",
             "out h? expert_rows workspace?", "kind transpose_rhs",
             "out[t] = sum over j in order of probs[t, j] * fc2(act(fc1(tokens[t]))) of expert "
             "expert_indices[t, j] - group_offset, token rows read through the routing; h [T, k, F_in] "
             "(fc1's output per slot) when given; expert_rows [T * k, H] is scratch.") {
  ExpertMlpArgs a;
  set_common(a, call);
  const ArgView b_in = call.array("b_in"), out = call.array("out"), h = call.array("h"),
                rows = call.array("expert_rows");
  if (b_in.given())
    expect_shape(b_in, {a.num_experts, a.in_features}), expect_dtype(b_in, a.dtype, "tokens"),
        a.b_in = b_in.data;
  expect_shape(out, {a.num_tokens, a.hidden}), expect_dtype(out, a.dtype, "tokens");
  if (h.given()) expect_shape(h, {a.num_tokens, a.top_k, a.in_features}), expect_dtype(h, a.dtype, "tokens");
  expect_shape(rows, {a.num_tokens * a.top_k, a.hidden}), expect_dtype(rows, a.dtype, "tokens");
  a.out = out.data, a.h = h.data, a.expert_rows = rows.data;
  return expert_mlp(a, call.context);
}

GROUPGEMM_OP(expert_mlp_backward, "groupgemm_expert_mlp_backward",
             "dout tokens expert_indices probs? w_in w_out b_out? group_offset? h",
             "dtokens? dw_in? dw_out? dprobs? db_in? db_out? token_rows? workspace?", "kind transpose_rhs",
             "Each gradient given, from the forward's h: dtokens, dw_in, dw_out, dprobs (dot(dout[t], y) "
             "through dout @ w_out^T), db_in, db_out; token_rows [T * k, H] is scratch, needed with "
             "dtokens.") {
  ExpertMlpBackwardArgs a;
  set_common(a, call);
  const ArgView dout = call.array("dout"), h = call.array("h"), dtokens = call.array("dtokens"),
                dw_in = call.array("dw_in"), dw_out = call.array("dw_out"), dprobs = call.array("dprobs"),
                db_in = call.array("db_in"), db_out = call.array("db_out"), rows = call.array("token_rows");
  expect_shape(dout, {a.num_tokens, a.hidden}), expect_dtype(dout, a.dtype, "tokens");
  expect_shape(h, {a.num_tokens, a.top_k, a.in_features}), expect_dtype(h, a.dtype, "tokens");
  const ArgView w_in = call.array("w_in"), w_out = call.array("w_out");
  const auto like = [&](const ArgView& grad, const ArgView& of) {  // a gradient in its parameter's shape
    if (!grad.given()) return static_cast<void*>(nullptr);
    expect_rank(grad, of.rank);
    for (int axis = 0; axis < of.rank; ++axis) expect_dim(grad, axis, of.dims[axis]);
    expect_dtype(grad, a.dtype, "tokens");
    return grad.data;
  };
  a.dtokens = like(dtokens, call.array("tokens")), a.dw_in = like(dw_in, w_in),
  a.dw_out = like(dw_out, w_out);
  if (db_in.given())
    expect_shape(db_in, {a.num_experts, a.in_features}), expect_dtype(db_in, a.dtype, "tokens"),
        a.db_in = db_in.data;
  if (db_out.given())
    expect_shape(db_out, {a.num_experts, a.hidden}), expect_dtype(db_out, a.dtype, "tokens"),
        a.db_out = db_out.data;
  if (dprobs.given()) {
    expect_shape(dprobs, {a.num_tokens, a.top_k});
    if (a.probs)
      expect_dtype(dprobs, a.probs_dtype, "probs");
    else
      a.probs_dtype = float_dtype(dprobs);
    a.dprobs = dprobs.data;
  }
  if (rows.given())
    expect_shape(rows, {a.num_tokens * a.top_k, a.hidden}), expect_dtype(rows, a.dtype, "tokens");
  a.dout = dout.data, a.h = h.data, a.token_rows = rows.data;
  return expert_mlp_backward(a, call.context);
}

}  // namespace
}  // namespace groupgemm
