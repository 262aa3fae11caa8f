// The CUDA backend's fused expert MLP (groupgemm/expert_mlp.h) as a call sequence, written
// once: which steps the forward and the backward run, in which order, and the operands of
// each. cuda/expert_mlp.cu runs it with a launcher that enqueues CUDA kernels; the core
// tests run it with a launcher that executes each step on the host over the same workspace
// bytes, so the sequence, its index arithmetic and its exact zeros are tested without a GPU.
// Plain C++: no CUDA header.
//
// The routing's counting sort gives each kept slot a row (experts ascending); the setup
// then writes, per local expert, one problem of each grouped GEMM the call runs. Three of
// them read token rows (or dout's) through the rows' token indices instead of a copy
// (Gather): fc1 (A's rows), fc2's input gradient (A's rows) and w_in's gradient (the rows
// are its contraction: A's K, or B's K with transposed weights). The rest read row scratch
// written in routing order. An expert without rows gets no tile and, in a weight gradient,
// exact zeros; a GEMM whose contraction is empty (H, F or F_in = 0) is replaced by a fill.
//
// A launcher provides, each returning a Status and each one kernel launch unless it says
// otherwise:
//   start()                              once, after the early exits (CUDA: the operands' device)
//   route(const ExpertRouteArgs&)        the counting sort (4 launches) into the workspace
//   setup(const ExpertSetupArgs&)        every expert's problems of every GEMM set
//   gemm(const ExpertGemmCall&)          one grouped GEMM, gathered or not
//   fill_rows(const ExpertFillArgs&)     kept rows := their expert's bias row, or zeros
//   forward_rows(const ForwardRowsArgs&) h in slot order, then the activation (2 launches)
//   backward_rows(const BackwardRowsArgs&)  the activation again, dprobs, the output gradients
//   expert_sums(const ExpertSumArgs&)    a bias gradient: each expert's rows summed
//   zero_idle(const IdleFillArgs&)       the weight-gradient blocks of experts without rows
//   unpermute(const UnpermuteArgs&)      each token's rows summed in slot order
#pragma once

#include <cstdint>
#include <initializer_list>

#include "call_sequence.h"
#include "expert_mlp_workspace.h"
#include "gather.h"
#include "gemm_call.h"
#include "groupgemm/activation.h"
#include "groupgemm/problem.h"
#include "groupgemm/types.h"

namespace groupgemm {

// The MLP's grouped GEMMs.
enum class ExpertGemm : int {
  fc1,        // h = tokens[rows] @ w_in[e] (+ b_in[e])          gathers A's rows
  fc2,        // y = act @ w_out[e] (+ b_out[e])
  fc2_dgrad,  // g = dout[rows] @ w_out[e]^T                     gathers A's rows
  fc2_wgrad,  // dw_out[e] = act^T @ dy (transposed: dy^T @ act)
  fc1_wgrad,  // dw_in[e] = tokens[rows]^T @ dh (transposed: dh^T @ tokens[rows])   gathers K
  fc1_dgrad,  // token_rows = dh @ w_in[e]^T
};

struct ExpertDims {
  int64_t hidden, in_features, out_features;
  bool transpose_rhs;  // w_in [E, F_in, H] and w_out [E, H, F]
};

// One expert's problem of a GEMM: the grouped path's forward or weight-gradient problem
// (groupgemm/problem.h), its gathered operand read from its base (the indices name rows).
struct ExpertProblem {
  GroupProblem problem;
  Gather gather;
};

GG_HD ExpertProblem expert_problem(ExpertGemm gemm, RowRange rows, int64_t e, const ExpertDims& d) {
  const int64_t h = d.hidden, f_in = d.in_features, f = d.out_features;
  const bool t = d.transpose_rhs;
  ExpertProblem p{};
  switch (gemm) {
    case ExpertGemm::fc1:
      p = {forward_problem(rows, e, h, f_in, t), Gather::a_rows};
      p.problem.a_offset = 0;
      break;
    case ExpertGemm::fc2: p = {forward_problem(rows, e, f, h, t), Gather::none}; break;
    case ExpertGemm::fc2_dgrad:
      p = {forward_problem(rows, e, h, f, !t), Gather::a_rows};
      p.problem.a_offset = 0;
      break;
    case ExpertGemm::fc2_wgrad:
      p = {wgrad_problem(rows, e, t ? h : f, t ? f : h, false), Gather::none};
      break;
    case ExpertGemm::fc1_wgrad:
      p = {wgrad_problem(rows, e, t ? f_in : h, t ? h : f_in, false), t ? Gather::b_k : Gather::a_k};
      if (t)
        p.problem.b_offset = 0;
      else
        p.problem.a_offset = 0;
      break;
    case ExpertGemm::fc1_dgrad: p = {forward_problem(rows, e, f_in, h, !t), Gather::none}; break;
  }
  return p;
}

GG_HD GemmLayout expert_gemm_layout(ExpertGemm gemm, bool transpose_rhs) {
  switch (gemm) {
    case ExpertGemm::fc1:
    case ExpertGemm::fc2: return transpose_rhs ? GemmLayout::row_col : GemmLayout::row_row;
    case ExpertGemm::fc2_dgrad:
    case ExpertGemm::fc1_dgrad: return transpose_rhs ? GemmLayout::row_row : GemmLayout::row_col;
    default: return GemmLayout::col_row;
  }
}

GG_HD Gather expert_gemm_gather(ExpertGemm gemm, bool transpose_rhs) {
  return expert_problem(gemm, RowRange{0, 1}, 0, ExpertDims{1, 1, 1, transpose_rhs}).gather;
}

// ---- the steps' arguments ------------------------------------------------------------------

struct ExpertRouteArgs {
  IndexArray expert_indices, group_offset;
  int64_t num_slots, num_experts, top_k, chunks;
  ExpertMlpView ws;
};

// One GEMM set of the setup: its GEMM and operand bases (d null: the set is not written).
struct ExpertGemmSetup {
  ExpertGemm gemm;
  GemmOperands operands;
};

struct ExpertSetupArgs {
  ExpertDims dims;
  int64_t num_experts;
  ExpertGemmSetup set[kExpertGemmSets];
  ExpertMlpView ws;
};

// Expert e's entry of one set: its problem, pointers and leading dimensions, and its gather
// indices (the token indices of its rows).
GG_HD void write_expert_set(const ExpertGemmSetup& s, const ExpertDims& d, const ExpertMlpView& ws, int set,
                            int64_t e) {
  if (!s.operands.d) return;
  const RowRange rows = expert_rows(ws.bucket_start, e);
  const ExpertProblem p = expert_problem(s.gemm, rows, e, d);
  write_group(ws.gemm[set], e, p.problem, s.operands);
  ws.gather[set][e] = p.gather == Gather::none ? nullptr : ws.token_of_row + rows.begin;
}

// Every set of expert e, by constant index (indexing a kernel's argument at run time would
// copy it to local memory).
GG_HD void write_expert_setup(const ExpertSetupArgs& a, int64_t e) {
  static_assert(kExpertGemmSets == 4, "one line per GEMM set");
  write_expert_set(a.set[0], a.dims, a.ws, 0, e);
  write_expert_set(a.set[1], a.dims, a.ws, 1, e);
  write_expert_set(a.set[2], a.dims, a.ws, 2, e);
  write_expert_set(a.set[3], a.dims, a.ws, 3, e);
}

// One grouped GEMM over a set's arrays: call.set names it, `arrays` and `gather_indices` are
// its device arrays.
struct ExpertGemmCall {
  GroupedGemmCall call;
  GemmArrays arrays;
  const int32_t* const* gather_indices;
  Gather gather;
  bool aligned;  // 16-bit operands: every row 16-byte aligned (the tensor-core kernels)
};

// Kept rows [0, kept) of `out` [T * k, n]: their expert's bias row, or zeros (a GEMM over an
// empty contraction).
struct ExpertFillArgs {
  void* out;
  DType dtype;  // out's and bias's
  int64_t n;
  const void* bias;  // [E, n], or null
  int64_t num_slots, num_experts;
  const int32_t* kept_rows;
  const int32_t* bucket_start;
};

// The forward between its GEMMs: h[s] = fc1_rows[row_map[s]] (zeros for a dropped slot),
// when h is wanted; act[r] = the activation of fc1_rows[r] for the kept rows.
struct ForwardRowsArgs {
  DType dtype;
  Activation activation;
  int64_t num_slots, in_features, out_features;
  const int32_t* kept_rows;
  const int32_t* row_map;
  const void* fc1_rows;
  void* h;  // or null
  void* act_rows;
};

// The backward between its GEMMs, kept row r of slot s = slot_of_row[r], token t = s / k,
// expert e, weight p = probs[s] (1 without probs), with the activation recomputed from h[s]:
//   act[r]      = act(h[s])                                   (with act_rows)
//   dprobs[s]   = dot(act[r], g[r]) + dot(b_out[e], dout[t])  (with dprobs; 0 for a dropped slot)
//   dy[r]       = p * dout[t], rounded                        (with dy_rows)
//   dh[r]       = act'(h[s]) * (p * g[r])                     (with dh_rows)
// each dot in permute.h's fixed lane order (a warp per row on the GPU).
struct BackwardRowsArgs {
  DType dtype, probs_dtype;
  Activation activation;
  int64_t num_slots, top_k, hidden, in_features, out_features, num_experts;
  const int32_t* kept_rows;
  const int32_t* bucket_start;
  const int32_t* row_map;
  const int32_t* slot_of_row;
  const void* h;
  const void* dout;
  const void* probs;  // or null
  const void* b_out;  // or null
  const float* grad_rows;
  void* act_rows;  // or null: not wanted
  void* dprobs;
  void* dy_rows;
  void* dh_rows;
};

// out[e, j] = the sum of column j of expert e's rows of `rows` [T * k, n], in row order in
// float32, rounded once; exactly 0 for an expert without rows.
struct ExpertSumArgs {
  DType dtype;
  const void* rows;
  void* out;
  int64_t n, num_experts;
  const int32_t* bucket_start;
};

// Exact zeros for each expert without rows: its block_bytes of `out`.
struct IdleFillArgs {
  void* out;
  int64_t block_bytes, num_experts;
  const int32_t* bucket_start;
};

// ---- the sequence --------------------------------------------------------------------------

// The workspace's shape of a forward (ExpertMlpArgs) or backward (ExpertMlpBackwardArgs) call.
template <typename Args>
ExpertMlpShape shape_of(const Args& a, bool backward) {
  return {a.num_tokens * a.top_k,
          a.num_experts,
          a.hidden,
          a.in_features,
          activation_out_features(a.activation, a.in_features),
          dtype_size(a.dtype),
          backward};
}

// 16-bit operands reach the tensor-core kernels when every row of every GEMM operand starts
// on a 16-byte boundary: H, F_in and F multiples of 8 and every base 16-byte aligned (the
// experts' rows and blocks then are too). float32 runs at any alignment.
inline bool expert_mlp_aligned(DType dtype, const ExpertDims& d, std::initializer_list<const void*> bases) {
  if (dtype == DType::f32) return true;
  if (d.hidden % 8 != 0 || d.in_features % 8 != 0 || d.out_features % 8 != 0) return false;
  for (const void* p : bases)
    if (p && !is_aligned16(p)) return false;
  return true;
}

inline GemmOperands operands(const void* a, const void* b, const void* c, void* d, DType in, DType out) {
  return {a, b, c, d, dtype_size(in), dtype_size(in), dtype_size(c ? in : out), dtype_size(out)};
}

// What both sequences share once the workspace is known: the route, and the GEMM and fill
// steps of one call.
template <typename Launcher>
class ExpertSteps {
 public:
  ExpertSteps(Launcher& launch, const ExpertMlpShape& shape, void* workspace, const ExpertDims& dims,
              DType dtype, bool aligned)
      : launch_(launch),
        shape_(shape),
        ws_(expert_mlp_view(workspace, shape)),
        dims_(dims),
        dtype_(dtype),
        aligned_(aligned) {}

  const ExpertMlpView& ws() const { return ws_; }

  template <typename Args>
  Status route(const Args& a) {
    const int64_t chunks = expert_mlp_layout(shape_).chunks;
    const int64_t slots = shape_.num_slots, experts = shape_.num_experts;
    return launch_.route(
        ExpertRouteArgs{a.expert_indices, a.group_offset, slots, experts, a.top_k, chunks, ws_});
  }

  // GEMM set `set` of `gemm`: every expert's problem, M = max_m at most (its rows, or a
  // weight gradient's fixed side), N = n; the output in `out`, + the bias row with `bias`.
  Status gemm(ExpertGemm gemm, int set, DType out, bool bias, int64_t max_m, int64_t n) {
    const GroupedGemmCall call{dtype_,      out,   expert_gemm_layout(gemm, dims_.transpose_rhs),
                               shape_.num_experts, bias ? GemmC::bias_row : GemmC::none,
                               max_m,       n,     set,
                               nullptr};
    return launch_.gemm(ExpertGemmCall{call, ws_.gemm[set], ws_.gather[set],
                                       expert_gemm_gather(gemm, dims_.transpose_rhs), aligned_});
  }

  // The kept rows of `rows` [T * k, n]: their expert's bias row, or zeros.
  Status fill(void* rows, DType dtype, int64_t n, const void* bias) {
    return launch_.fill_rows(ExpertFillArgs{rows, dtype, n, bias, shape_.num_slots, shape_.num_experts,
                                            ws_.kept_rows, ws_.bucket_start});
  }

  // out[e, :] = the sum of expert e's rows of `rows` [T * k, n].
  Status sums(const void* rows, void* out, int64_t n) {
    return launch_.expert_sums(ExpertSumArgs{dtype_, rows, out, n, shape_.num_experts, ws_.bucket_start});
  }

  // A weight gradient's blocks of the experts without rows: exact zeros.
  Status zero_idle(void* out, int64_t block_elements) {
    return launch_.zero_idle(
        IdleFillArgs{out, block_elements * dtype_size(dtype_), shape_.num_experts, ws_.bucket_start});
  }

 private:
  Launcher& launch_;
  ExpertMlpShape shape_;
  ExpertMlpView ws_;
  ExpertDims dims_;
  DType dtype_;
  bool aligned_;
};

// The forward: route, set up fc1 and fc2, fc1 (gathered) into the fc1 rows, h and the
// activation, fc2 into expert_rows, each token's weighted sum.
template <typename Launcher>
Status enqueue_expert_mlp(const ExpertMlpArgs& a, void* workspace, Launcher& launch) {
  const ExpertMlpShape shape = shape_of(a, false);
  const int64_t slots = shape.num_slots, f_in = a.in_features, f = shape.out_features, hidden = a.hidden;
  const bool want_h = a.h != nullptr && slots * f_in > 0;
  if (a.num_tokens * hidden == 0 && !want_h) return Status::Ok();  // nothing to write
  GG_RETURN_IF_ERROR(launch.start());
  const ExpertDims dims{hidden, f_in, f, a.transpose_rhs};
  const DType t = a.dtype;
  const bool aligned =
      expert_mlp_aligned(t, dims, {a.tokens, a.w_in, a.w_out, a.b_in, a.b_out, a.expert_rows, workspace});
  ExpertSteps<Launcher> steps(launch, shape, workspace, dims, t, aligned);
  const ExpertMlpView& ws = steps.ws();
  GG_RETURN_IF_ERROR(steps.route(a));
  if (slots > 0) {
    ExpertSetupArgs s{dims, a.num_experts, {}, ws};
    s.set[0] = {ExpertGemm::fc1, operands(a.tokens, a.w_in, a.b_in, ws.fc1_rows, t, t)};
    s.set[1] = {ExpertGemm::fc2, operands(ws.act_rows, a.w_out, a.b_out, a.expert_rows, t, t)};
    GG_RETURN_IF_ERROR(launch.setup(s));
    if (f_in > 0)
      GG_RETURN_IF_ERROR(hidden > 0 ? steps.gemm(ExpertGemm::fc1, 0, t, a.b_in != nullptr, slots, f_in)
                                    : steps.fill(ws.fc1_rows, t, f_in, a.b_in));
    GG_RETURN_IF_ERROR(launch.forward_rows(ForwardRowsArgs{t, a.activation, slots, f_in, f, ws.kept_rows,
                                                           ws.row_map, ws.fc1_rows, want_h ? a.h : nullptr,
                                                           ws.act_rows}));
    if (hidden > 0)
      GG_RETURN_IF_ERROR(f > 0 ? steps.gemm(ExpertGemm::fc2, 1, t, a.b_out != nullptr, slots, hidden)
                               : steps.fill(a.expert_rows, t, hidden, a.b_out));
  }
  if (a.num_tokens * hidden == 0) return Status::Ok();
  UnpermuteArgs sum;  // out[t]: its slots' weighted expert outputs, in slot order
  sum.dtype = t, sum.probs_dtype = a.probs_dtype, sum.permuted = a.expert_rows, sum.row_map = ws.row_map;
  sum.probs = a.probs, sum.out = a.out;
  sum.num_rows = slots, sum.num_tokens = a.num_tokens, sum.top_k = a.top_k, sum.hidden = hidden;
  return launch.unpermute(sum);
}

// The backward: route, set up its four GEMMs, g = dout[rows] @ w_out^T (gathered), the
// row step (activation, dprobs, dy, dh), w_out's gradient and b_out's, w_in's (gathered
// along its contraction) and b_in's, the token rows' input gradients and their per-token sums.
template <typename Launcher>
Status enqueue_expert_mlp_backward(const ExpertMlpBackwardArgs& a, void* workspace, Launcher& launch) {
  const ExpertMlpShape shape = shape_of(a, true);
  const int64_t slots = shape.num_slots, f_in = a.in_features, f = shape.out_features, hidden = a.hidden;
  const int64_t e = a.num_experts;
  const bool dtokens = a.dtokens && a.num_tokens * hidden > 0, dprobs = a.dprobs && slots > 0;
  const bool dw_in = a.dw_in && e * hidden * f_in > 0, dw_out = a.dw_out && e * f * hidden > 0;
  const bool db_in = a.db_in && e * f_in > 0, db_out = a.db_out && e * hidden > 0;
  if (!(dtokens || dprobs || dw_in || dw_out || db_in || db_out)) return Status::Ok();  // nothing to write
  GG_RETURN_IF_ERROR(launch.start());
  const ExpertDims dims{hidden, f_in, f, a.transpose_rhs};
  const DType t = a.dtype;
  const bool tr = a.transpose_rhs;
  const bool aligned = expert_mlp_aligned(
      t, dims, {a.dout, a.tokens, a.w_in, a.w_out, a.dw_in, a.dw_out, a.token_rows, workspace});
  ExpertSteps<Launcher> steps(launch, shape, workspace, dims, t, aligned);
  const ExpertMlpView& ws = steps.ws();
  GG_RETURN_IF_ERROR(steps.route(a));
  const bool want_dh = dtokens || dw_in || db_in, want_dy = dw_out || db_out;
  const bool want_act = dprobs || dw_out, want_g = want_dh || dprobs;
  if (slots > 0) {
    void* dw_out_d = dw_out ? a.dw_out : nullptr;
    void* dw_in_d = dw_in ? a.dw_in : nullptr;
    ExpertSetupArgs s{dims, e, {}, ws};
    s.set[0] = {ExpertGemm::fc2_dgrad,
                operands(a.dout, a.w_out, nullptr, want_g ? ws.grad_rows : nullptr, t, DType::f32)};
    s.set[1] = {ExpertGemm::fc2_wgrad, tr ? operands(ws.dy_rows, ws.act_rows, nullptr, dw_out_d, t, t)
                                          : operands(ws.act_rows, ws.dy_rows, nullptr, dw_out_d, t, t)};
    s.set[2] = {ExpertGemm::fc1_wgrad, tr ? operands(ws.fc1_rows, a.tokens, nullptr, dw_in_d, t, t)
                                          : operands(a.tokens, ws.fc1_rows, nullptr, dw_in_d, t, t)};
    s.set[3] = {ExpertGemm::fc1_dgrad,
                operands(ws.fc1_rows, a.w_in, nullptr, dtokens ? a.token_rows : nullptr, t, t)};
    GG_RETURN_IF_ERROR(launch.setup(s));
    if (want_g && f > 0)
      GG_RETURN_IF_ERROR(hidden > 0 ? steps.gemm(ExpertGemm::fc2_dgrad, 0, DType::f32, false, slots, f)
                                    : steps.fill(ws.grad_rows, DType::f32, f, nullptr));
    BackwardRowsArgs r{t,
                       a.probs_dtype,
                       a.activation,
                       slots,
                       a.top_k,
                       hidden,
                       f_in,
                       f,
                       e,
                       ws.kept_rows,
                       ws.bucket_start,
                       ws.row_map,
                       ws.slot_of_row,
                       a.h,
                       a.dout,
                       a.probs,
                       a.b_out,
                       ws.grad_rows,
                       want_act ? ws.act_rows : nullptr,
                       dprobs ? a.dprobs : nullptr,
                       want_dy ? ws.dy_rows : nullptr,
                       want_dh ? ws.fc1_rows : nullptr};
    GG_RETURN_IF_ERROR(launch.backward_rows(r));
  }
  if (dw_out) {
    GG_RETURN_IF_ERROR(steps.zero_idle(a.dw_out, f * hidden));
    if (slots > 0)
      GG_RETURN_IF_ERROR(steps.gemm(ExpertGemm::fc2_wgrad, 1, t, false, tr ? hidden : f, tr ? f : hidden));
  }
  if (db_out) GG_RETURN_IF_ERROR(steps.sums(ws.dy_rows, a.db_out, hidden));
  if (dw_in) {
    GG_RETURN_IF_ERROR(steps.zero_idle(a.dw_in, hidden * f_in));
    if (slots > 0)
      GG_RETURN_IF_ERROR(
          steps.gemm(ExpertGemm::fc1_wgrad, 2, t, false, tr ? f_in : hidden, tr ? hidden : f_in));
  }
  if (db_in) GG_RETURN_IF_ERROR(steps.sums(ws.fc1_rows, a.db_in, f_in));
  if (!dtokens) return Status::Ok();
  if (slots > 0)
    GG_RETURN_IF_ERROR(f_in > 0 ? steps.gemm(ExpertGemm::fc1_dgrad, 3, t, false, slots, hidden)
                                : steps.fill(a.token_rows, t, hidden, nullptr));
  UnpermuteArgs sum;  // dtokens[t]: its slots' input gradients, in slot order
  sum.dtype = t, sum.permuted = a.token_rows, sum.row_map = ws.row_map, sum.out = a.dtokens;
  sum.num_rows = slots, sum.num_tokens = a.num_tokens, sum.top_k = a.top_k, sum.hidden = hidden;
  return launch.unpermute(sum);
}

}  // namespace groupgemm
