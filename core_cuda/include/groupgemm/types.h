// Plain data types shared by the core API, the CPU backend and the CUDA backend.
// Nothing here knows about Python, JAX or PyTorch.
#pragma once

#include <cstdint>
#include <string>

namespace groupgemm {

// Every floating-point dtype the core knows, one row each: enum name, the name messages
// use, bytes per element. The enum values follow the rows (f32 = 0, bf16 = 1, ...), so a
// new dtype goes last.
#define GROUPGEMM_DTYPES(X) \
  X(f32, "float32", 4)      \
  X(bf16, "bfloat16", 2)    \
  X(f16, "float16", 2)      \
  X(f64, "float64", 8)

enum class DType : int {
#define GG_DTYPE_ENUMERATOR(id, name, bytes) id,
  GROUPGEMM_DTYPES(GG_DTYPE_ENUMERATOR)
#undef GG_DTYPE_ENUMERATOR
};
enum class IndexType : int { i32 = 0, i64 = 1 };
enum class Device : int { cpu = 0, cuda = 1 };

#define GG_DTYPE_COUNT(id, name, bytes) +1
constexpr int kNumDTypes = 0 GROUPGEMM_DTYPES(GG_DTYPE_COUNT);
#undef GG_DTYPE_COUNT

inline int64_t dtype_size(DType t) {
  switch (t) {
#define GG_DTYPE_SIZE(id, name, bytes) \
  case DType::id: return bytes;
    GROUPGEMM_DTYPES(GG_DTYPE_SIZE)
#undef GG_DTYPE_SIZE
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
#define GG_DTYPE_NAME(id, name, bytes) \
  case DType::id: return name;
    GROUPGEMM_DTYPES(GG_DTYPE_NAME)
#undef GG_DTYPE_NAME
  }
  return "unknown";
}

// Result of every core entry point: ok, or a message a frontend can show as is.
struct Status {
  enum class Code : int { ok = 0, invalid_argument = 1, unimplemented = 2, internal = 3 };
  Code code = Code::ok;
  std::string message;

  static Status Ok() { return {}; }
  static Status Invalid(std::string m) { return {Code::invalid_argument, std::move(m)}; }
  static Status Unimplemented(std::string m) { return {Code::unimplemented, std::move(m)}; }
  static Status Internal(std::string m) { return {Code::internal, std::move(m)}; }
  bool ok() const { return code == Code::ok; }
};

#define GG_RETURN_IF_ERROR(expr) \
  do {                           \
    Status s_ = (expr);          \
    if (!s_.ok()) return s_;     \
  } while (0)

// A 1-D integer array (group_sizes) or a scalar (group_offset, count == 1) that lives
// on the same device as the operands. The core reads it there: never a host copy.
struct IndexArray {
  const void* data = nullptr;  // nullptr means "absent" (group_offset defaults to 0)
  IndexType type = IndexType::i32;
  int64_t count = 0;
  // Group sizes only: the array holds cumulative group ends (torch._grouped_mm's offs),
  // size g = ends[g] - ends[g - 1] with ends[-1] = 0, read on the device like sizes.
  bool cumulative = false;
};

// Where and how to run: device, its stream (cudaStream_t on CUDA, ignored on CPU),
// and a caller-provided workspace (an XLA output buffer or a framework tensor), so the
// core never allocates device memory at run time.
struct ExecContext {
  Device device = Device::cpu;
  int device_index = -1;  // CUDA device of the operands; -1: the current device
  void* stream = nullptr;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

// out[M, N] = lhs[M, K] @ rhs[g] (+ bias[g]) for the rows of local group g; padding rows 0.
// rhs is [G, K, N], or [G, N, K] when transpose_rhs. bias is [G, N] in in_dtype, or null.
// The dgrad of a grouped matmul is this same call on (dout, rhs, !transpose_rhs).
struct MatmulArgs {
  DType in_dtype = DType::f32;   // lhs, rhs and bias
  DType out_dtype = DType::f32;  // in_dtype, or float32 for 16-bit inputs
  const void* lhs = nullptr;
  const void* rhs = nullptr;
  const void* bias = nullptr;
  void* out = nullptr;
  int64_t m = 0, k = 0, n = 0;
  int64_t num_groups = 0;  // G: local experts held in rhs
  bool transpose_rhs = false;
  IndexArray group_sizes;   // [G_total] raw sizes; negative counts as 0
  IndexArray group_offset;  // scalar; global index of local group 0
};

// out[g] (=|+=) lhs_g^T @ grad_g over the rows of local group g. out is [G, K, N].
// accumulate: out is a float32 (float64 for float64 inputs) buffer updated in place and
// an empty group leaves out[g] bit-for-bit unchanged; otherwise an empty group gives 0.
struct WgradArgs {
  DType in_dtype = DType::f32;  // lhs and grad
  DType out_dtype = DType::f32;
  const void* lhs = nullptr;   // [M, K]
  const void* grad = nullptr;  // [M, N]
  void* out = nullptr;         // [G, K, N]
  int64_t m = 0, k = 0, n = 0;
  int64_t num_groups = 0;
  bool accumulate = false;
  IndexArray group_sizes;
  IndexArray group_offset;
};

// The backward of out = lhs @ rhs[g] (+ bias[g]) (MatmulArgs) from its incoming gradient,
// every requested gradient from one setup: dlhs = grad @ rhs[g]^T (padding rows 0),
// drhs[g] = the weight gradient in rhs's layout (empty groups 0, or untouched when
// accumulating), dbias[g] = the sum of grad's rows of group g. Each is the same
// computation, to the bit, as the corresponding separate entry point (grouped_matmul
// with the transpose flipped, grouped_matmul_wgrad, grouped_bias_grad).
struct BackwardArgs {
  DType in_dtype = DType::f32;  // lhs, rhs, grad and dlhs
  const void* lhs = nullptr;    // [M, K]
  const void* rhs = nullptr;    // [G, K, N], or [G, N, K] when transpose_rhs
  const void* grad = nullptr;   // [M, N]
  void* dlhs = nullptr;         // [M, K], or null: not wanted
  void* drhs = nullptr;         // rhs's shape, or null: not wanted
  DType drhs_dtype = DType::f32;
  bool accumulate = false;  // drhs is a float32 (float64) buffer added into in place
  void* dbias = nullptr;    // [G, N], or null: not wanted
  DType dbias_dtype = DType::f32;
  int64_t m = 0, k = 0, n = 0;
  int64_t num_groups = 0;
  bool transpose_rhs = false;
  IndexArray group_sizes;
  IndexArray group_offset;
};

// out[g] = sum of grad rows of local group g (float32 accumulation, fixed order).
struct BiasGradArgs {
  DType in_dtype = DType::f32;
  DType out_dtype = DType::f32;
  const void* grad = nullptr;  // [M, N]
  void* out = nullptr;         // [G, N]
  int64_t m = 0, n = 0;
  int64_t num_groups = 0;
  IndexArray group_sizes;
  IndexArray group_offset;
};

// ---- the expert layer's token ops and activation ------------------------------------
// Slot s = t * k + j is token t's j-th expert choice. Row counts are int32 (row_map and
// group_sizes are int32 arrays), so T * k must stay below 2^31.

// The CUDA calls this process made on a stream (every entry point's launches), how many
// of them ran while their stream was capturing (a CUDA graph or an XLA command buffer
// being recorded) and whether the first one did: a capture check's positive evidence that
// the calls were recorded, not run beside the graph. All zero without CUDA.
struct CaptureRecord {
  int64_t calls = 0;
  int64_t calls_under_capture = 0;
  bool first_under_capture = false;
};

// permute: a stable counting sort of the T*k slots by expert. Rows of `permuted` are
// grouped by expert in ascending order, ascending slot order within an expert; slots whose
// expert index is outside [0, E) are dropped: they come last, as exact-zero rows.
// permuted[row_map[t, j]] = tokens[t] bit for bit; row_map[t, j] = -1 for a dropped slot;
// group_sizes[e] = kept slots of expert e. The CUDA backend needs
// permute_workspace_bytes(cuda, T * k, E) bytes of workspace.
struct PermuteArgs {
  DType dtype = DType::f32;        // tokens and permuted
  const void* tokens = nullptr;    // [T, H]
  IndexArray expert_indices;       // [T, k], int32 or int64, on the operands' device
  void* permuted = nullptr;        // [T * k, H]
  int32_t* group_sizes = nullptr;  // [E]
  int32_t* row_map = nullptr;      // [T, k]
  int64_t num_tokens = 0, top_k = 0, hidden = 0, num_experts = 0;
};

// unpermute: out[t] = sum over j = 0..k-1, in that order, of probs[t, j] * permuted[row_map[t, j]],
// accumulated in float32 (float64 for float64) and rounded once. A row_map entry outside
// [0, R) adds nothing (a dropped slot); without probs every weight is 1, which makes this
// permute's backward.
struct UnpermuteArgs {
  DType dtype = DType::f32;          // permuted and out
  DType probs_dtype = DType::f32;    // dtype, or float32
  const void* permuted = nullptr;    // [R, H]
  const int32_t* row_map = nullptr;  // [T, k]
  const void* probs = nullptr;       // [T, k], or null
  void* out = nullptr;               // [T, H]
  int64_t num_rows = 0, num_tokens = 0, top_k = 0, hidden = 0;
};

// unpermute's backward; each output is computed when its pointer is given (the
// frontends' reverse mode takes both, JAX's transposes one at a time):
//  - dpermuted[r] = the sum over the slots (t, j) with row_map[t, j] = r, in ascending
//    t*k + j order, of probs[t, j] * dout[t] (weight 1 without probs), in float32
//    (float64 for float64) and rounded once; a row no slot names is exactly 0. A row
//    named by several slots gets all their terms, as the forward adds them all;
//  - dprobs[t, j] = dot(permuted[row_map[t, j]], dout[t]) in float32 (float64 for
//    float64) in a fixed order, exactly 0 for a dropped slot; stored in probs_dtype.
// The CUDA backend needs unpermute_backward_workspace_bytes(cuda, T * k) bytes of
// workspace for dpermuted (the slots sorted by row).
struct UnpermuteBackwardArgs {
  DType dtype = DType::f32;          // dout, permuted and dpermuted
  DType probs_dtype = DType::f32;    // probs and dprobs: dtype, or float32
  const void* dout = nullptr;        // [T, H]
  const void* permuted = nullptr;    // [R, H]; read only for dprobs
  const int32_t* row_map = nullptr;  // [T, k]
  const void* probs = nullptr;       // [T, k], or null: every weight 1 (read only for dpermuted)
  void* dpermuted = nullptr;         // [R, H], or null: not computed
  void* dprobs = nullptr;            // [T, k], or null: not computed
  int64_t num_rows = 0, num_tokens = 0, top_k = 0, hidden = 0;
};

// The expert MLP's activation. swiglu takes [M, 2F] (the first F columns are the gate)
// to [M, F]: silu(gate) * up; the others are elementwise. Every one maps 0 to 0, so
// padding rows stay exactly zero.
enum class Activation : int { swiglu = 0, gelu = 1, relu = 2, silu = 3 };

// out[M, F] = act(h[M, F_in]), computed in float32 (float64 for float64), rounded once.
struct ActivationArgs {
  DType dtype = DType::f32;  // h and out
  Activation kind = Activation::swiglu;
  const void* h = nullptr;  // [M, F_in]
  void* out = nullptr;      // [M, F]: F = F_in / 2 for swiglu, else F_in
  int64_t rows = 0, in_features = 0;
};

// dh[M, F_in] = the exact derivative of act at h, times dout[M, F].
struct ActivationBackwardArgs {
  DType dtype = DType::f32;  // dout, h and dh
  Activation kind = Activation::swiglu;
  const void* dout = nullptr;  // [M, F]
  const void* h = nullptr;     // [M, F_in]
  void* dh = nullptr;          // [M, F_in]
  int64_t rows = 0, in_features = 0;
};

// ---- the fused expert MLP (groupgemm/expert_mlp.h has the routing) -------------------
// expert_mlp: permute, the grouped MLP and unpermute in one call, without the [T*k, H] copy
// of the tokens. A slot s = (t, j) whose expert id expert_indices[t, j] is local (global ids
// [group_offset, group_offset + E)) gives
//   y_s = act(tokens[t] @ w_in[e] + b_in[e]) @ w_out[e] + b_out[e],  e = id - group_offset,
// with h_s (fc1's output) and act(h_s) rounded to dtype as the composition stores them, and
//   out[t] = sum over j = 0..k-1, in that order, of probs[t, j] * y_(t, j)
// in float32 (float64 for float64), rounded once (weight 1 without probs). A slot with a
// negative id or one outside the window adds nothing. The expert outputs go through
// `expert_rows`, [T * k, H] of scratch (left undefined), so the per-token sum runs in
// slot order on every backend. (The CPU backend uses scratch of its own, kept from call
// to call, and leaves `expert_rows` and the backward's `token_rows` untouched.)
struct ExpertMlpArgs {
  DType dtype = DType::f32;        // tokens, weights, biases, out, h and expert_rows
  DType probs_dtype = DType::f32;  // dtype, or float32
  Activation activation = Activation::swiglu;
  const void* tokens = nullptr;  // [T, H]
  IndexArray expert_indices;     // [T, k] int32 or int64: global expert ids
  const void* probs = nullptr;   // [T, k], or null: every weight 1
  const void* w_in = nullptr;    // [E, H, F_in], or [E, F_in, H] when transpose_rhs
  const void* w_out = nullptr;   // [E, F, H], or [E, H, F] when transpose_rhs
  const void* b_in = nullptr;    // [E, F_in], or null
  const void* b_out = nullptr;   // [E, H], or null
  IndexArray group_offset;       // scalar: the global id of local expert 0; absent: 0
  void* out = nullptr;           // [T, H]
  void* h = nullptr;             // [T, k, F_in]: fc1's output per slot, 0 for a dropped one; or null
  void* expert_rows = nullptr;   // [T * k, H] scratch
  int64_t num_tokens = 0, top_k = 0, hidden = 0, in_features = 0, num_experts = 0;
  bool transpose_rhs = false;
};

// expert_mlp's backward from the forward's h, which it reads through the routing with
// dout, tokens and probs; the activation is recomputed from h. Each gradient is computed
// when its pointer is given, each in its parameter's shape and dtype:
//  - dprobs[t, j] = dot(dout[t], y_(t, j)) through groupgemm/expert_mlp.h's identity (no
//    expert output is needed; b_out enters it), 0 for a dropped slot;
//  - dtokens[t] = the sum over j, in slot order, of slot (t, j)'s input gradient, in
//    float32 (float64), rounded once; the terms go through `token_rows`, [T * k, H] of
//    scratch (needed with dtokens only);
//  - dw_in, dw_out, db_in, db_out: full shape; exact zeros for an expert without slots. Each
//    expert's weight gradients add its blocks of rows in order in float32 (float64).
struct ExpertMlpBackwardArgs {
  DType dtype = DType::f32;        // dout, tokens, weights, h and every gradient but dprobs
  DType probs_dtype = DType::f32;  // probs and dprobs: dtype, or float32
  Activation activation = Activation::swiglu;
  const void* dout = nullptr;    // [T, H]
  const void* tokens = nullptr;  // [T, H]
  IndexArray expert_indices;     // [T, k]
  const void* probs = nullptr;   // [T, k], or null: every weight 1
  const void* w_in = nullptr;    // as in ExpertMlpArgs
  const void* w_out = nullptr;
  const void* b_out = nullptr;  // [E, H], or null (dprobs reads it)
  IndexArray group_offset;
  const void* h = nullptr;     // [T, k, F_in] from the forward
  void* dtokens = nullptr;     // [T, H], or null: not wanted
  void* dprobs = nullptr;      // [T, k] in probs_dtype, or null
  void* dw_in = nullptr;       // w_in's shape, or null
  void* dw_out = nullptr;      // w_out's shape, or null
  void* db_in = nullptr;       // [E, F_in], or null
  void* db_out = nullptr;      // [E, H], or null
  void* token_rows = nullptr;  // [T * k, H] scratch, with dtokens
  int64_t num_tokens = 0, top_k = 0, hidden = 0, in_features = 0, num_experts = 0;
  bool transpose_rhs = false;
};

// The router's softmax top-k (groupgemm/router.h has the exact rule): for logits [T, E],
// the k chosen experts per token and their probabilities, in float32 (float64 for
// float64 logits).
struct SoftmaxTopkArgs {
  DType dtype = DType::f32;           // logits; probs are float32 (float64 for float64)
  const void* logits = nullptr;       // [T, E]
  int32_t* expert_indices = nullptr;  // [T, k]: chosen experts, -1 for a dropped slot
  void* probs = nullptr;              // [T, k]
  int64_t num_tokens = 0, num_experts = 0, top_k = 0;
  bool renormalize = true;
};

// dlogits[T, E] (logits' dtype) from the forward's logits and expert_indices and the
// incoming dprobs (probs' dtype): J^T dprobs, J the Jacobian of probs in logits with the
// choices held fixed.
struct SoftmaxTopkBackwardArgs {
  DType dtype = DType::f32;                 // logits and dlogits
  const void* logits = nullptr;             // [T, E]
  const int32_t* expert_indices = nullptr;  // [T, k]
  const void* dprobs = nullptr;             // [T, k]
  void* dlogits = nullptr;                  // [T, E]
  int64_t num_tokens = 0, num_experts = 0, top_k = 0;
  bool renormalize = true;
};

// Forward mode: tprobs[T, k] (probs' dtype) = J tlogits, the tangent of probs for the
// logits' tangent tlogits[T, E] (logits' dtype); exactly 0 at a dropped slot.
struct SoftmaxTopkTangentArgs {
  DType dtype = DType::f32;                 // logits and tlogits
  const void* logits = nullptr;             // [T, E]
  const int32_t* expert_indices = nullptr;  // [T, k]
  const void* tlogits = nullptr;            // [T, E]
  void* tprobs = nullptr;                   // [T, k]
  int64_t num_tokens = 0, num_experts = 0, top_k = 0;
  bool renormalize = true;
};

}  // namespace groupgemm
