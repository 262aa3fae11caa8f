// The CPU backend's fused expert MLP (groupgemm/expert_mlp.h). The routing runs on the host;
// then each local expert's rows are multiplied in blocks of up to 1024 rows: a
// block's token rows are gathered into a scratch and multiplied by the library GEMM
// (gemm.h), so no [T*k, H] copy of the tokens exists. Each expert's blocks run in order,
// its weights packed once for all of them (ExpertWeight). Forward, per block: fc1, its
// output scattered into h (slot order), the activation, fc2 into the expert-output scratch
// rows (row_scratch.h's, kept from call to call, not the caller's); then each token's
// weighted sum is unpermute's (expert_ops.cpp). Backward, per block: dout's rows gathered,
// g = dout @ w_out^T; then one pass per row (row_backward) recomputes the activation from
// the row's h where it lies (not copied), takes dprobs from the identity and fc1's output
// gradient from one sigmoid per value; the weight and bias gradients are added up in float32
// (float64), the input gradients' rows written to the token-row scratch, whose per-token
// sums are unpermute's again.
//
// The GEMMs and the activation are the grouped path's own calls (backend.cpp's library
// GEMM, expert_ops.cpp's activation) on a block's rows instead of a group's, with the bits
// of the grouped path's; the activation's derivative is activation.h's, per element. Every
// block runs on one thread, its expert's weight-gradient terms added in block order, or on
// all threads split by rows or inside a library GEMM whose bits do not depend on them
// (gemm_threading), so the results do not depend on the thread count.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "backends.h"
#include "convert.h"
#include "float_mode.h"
#include "gemm.h"
#include "groupgemm/activation.h"
#include "groupgemm/expert_mlp.h"
#include "huge_pages.h"
#include "row_scratch.h"
#include "sigmoid_rows.h"
#include "thread_plan.h"
#include "values.h"

namespace groupgemm {
namespace cpu {
namespace {

// The GEMMs' operand type: float16 has no fast library kernel, so its operands are widened
// to float32 and each product rounded once (as backend.cpp's float16 GEMMs).
template <typename T>
using GemmIn = std::conditional_t<std::is_same_v<T, f16_t>, float, T>;
template <typename T>
constexpr bool kWidened = !std::is_same_v<GemmIn<T>, T>;

template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, double>)
    return DType::f64;
  else if constexpr (std::is_same_v<T, bf16_t>)
    return DType::bf16;
  else if constexpr (std::is_same_v<T, f16_t>)
    return DType::f16;
  else
    return DType::f32;
}

// A block holds as many rows as keep its gathered token rows within 4 MiB, 128 to 1024
// rows. Each block's GEMMs read the expert's weight afresh (oneDNN copies it into its own
// layout per call unless pack_b did), so short blocks spend more of their time copying:
// on a 2-core AVX-512 VM, float32 forward+backwards at H = 1024, F = 384 took 0-6% less
// time with blocks of 1024 rows than with 512 (five runs, each interleaved in one process),
// and no less with 2048; at F = 128 and in bfloat16 the three were alike.
constexpr int64_t kBlockBytes = int64_t(4) << 20;
constexpr int64_t kMinBlockRows = 128, kMaxBlockRows = 1024;

int64_t rows_per_block(int64_t hidden, int64_t element_bytes) {
  const int64_t rows = kBlockBytes / std::max<int64_t>(hidden * element_bytes, 1);
  return std::clamp(rows / kContractionStep * kContractionStep, kMinBlockRows, kMaxBlockRows);
}

// Where blocks of an expert's rows start: at whole contraction steps, so that only an
// expert's last block is padded by its weight gradients' GEMMs (gemm.h); blocks of fewer
// rows than two steps (the tests' short ones) anywhere.
int64_t block_step(int64_t block_rows, int64_t expert_rows, int64_t count) {
  const bool whole_steps = block_rows % kContractionStep == 0 && expert_rows >= count * kContractionStep;
  return whole_steps ? kContractionStep : 1;
}

// The routing of expert_mlp.h on the host (one chunk).
struct Routing {
  std::vector<int32_t> row_map, slot_of_row, bucket_start;
  int64_t kept = 0;

  template <typename Args>
  explicit Routing(const Args& a)
      : row_map(a.num_tokens * a.top_k),
        slot_of_row(a.num_tokens * a.top_k),
        bucket_start(a.num_experts + 1) {
    std::vector<int32_t> counts(count_entries(a.num_experts, 1));
    kept = expert_routing_on_host(a.expert_indices, a.num_tokens * a.top_k, a.group_offset, a.num_experts, 1,
                                  counts.data(), bucket_start.data(), row_map.data(), slot_of_row.data());
  }
  RowRange rows(int64_t expert) const { return expert_rows(bucket_start.data(), expert); }
};

// A weight or bias as the GEMMs take it: the caller's array, or for float16 a float32 copy
// made once per call.
template <typename T>
class GemmOperand {
 public:
  GemmOperand(const void* data, int64_t count) {
    if constexpr (kWidened<T>) {
      if (data == nullptr) return;
      widened_.resize(count);
      convert(data, DType::f16, widened_.data(), DType::f32, count);
      data_ = widened_.data();
    } else {
      data_ = static_cast<const T*>(data);
    }
  }
  const GemmIn<T>* at(int64_t offset) const { return data_ ? data_ + offset : nullptr; }

 private:
  std::vector<float> widened_;
  const GemmIn<T>* data_ = nullptr;
};

// One library GEMM with the bits it has on one thread: inside a parallel region it runs on
// the calling thread; outside one (an expert run alone), the library threads it unless that
// could change the order of its sums (gemm_threading).
Status run_gemm(const GemmCall& c) {
  if (omp_in_parallel() || gemm_threading(c) != Threading::one) return gemm(c);
  // The workers get the core's float mode now, while the team is whole: set up inside the
  // one-thread GEMM below, it would reach no worker, and the later parallel work would
  // find it done (float_mode.h).
  before_parallel_work();
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Status s = gemm(c);
  omp_set_num_threads(threads);
  return s;
}

// C[m, n] = A[m, k] @ B (+ bias), or += when accumulating; over k = 0 the product is empty:
// C is the bias rows, or zeros. Callers fill everything but c and out_dtype.
Status multiply(const GemmCall& c) {
  if (c.m == 0 || c.n == 0) return Status::Ok();
  if (c.k > 0) return run_gemm(c);
  if (c.accumulate) return Status::Ok();
  const int64_t row_bytes = c.n * dtype_size(c.out_dtype);
  for (int64_t i = 0; i < c.m; ++i) {
    char* row = static_cast<char*>(c.c) + i * row_bytes;
    if (c.bias)
      convert(c.bias, c.in_dtype, row, c.out_dtype, c.n);
    else
      std::memset(row, 0, row_bytes);
  }
  return Status::Ok();
}

template <typename G>
GemmCall gemm_call(int64_t m, int64_t n, int64_t k, const G* a, bool a_transposed, const G* b,
                   bool b_transposed, const G* bias = nullptr) {
  return {dtype_of<G>(), dtype_of<G>(), m, n, k, a, a_transposed, b, b_transposed, bias, nullptr, false};
}

// A product stored in T (h, expert outputs, input gradients): float16's runs in float32
// and is rounded once; the others' GEMMs write T themselves.
template <typename T>
Status multiply_into(GemmCall c, T* out, std::vector<float>& wide) {
  if constexpr (kWidened<T>) {
    wide.resize(c.m * c.n);
    c.out_dtype = DType::f32, c.c = wide.data();
    GG_RETURN_IF_ERROR(multiply(c));
    convert(wide.data(), DType::f32, out, DType::f16, c.m * c.n);
    return Status::Ok();
  } else {
    c.out_dtype = dtype_of<T>(), c.c = out;
    return multiply(c);
  }
}

// A product accumulated in Acc<T> (g, the weight gradients).
template <typename T>
Status multiply_acc(GemmCall c, Acc<T>* out, bool accumulate) {
  c.out_dtype = dtype_of<Acc<T>>(), c.c = out, c.accumulate = accumulate;
  return multiply(c);
}

// An expert's weight gradient, the sum of its blocks' products: added up in place (float32,
// float64), else in a float32 scratch rounded into it once at the end (float16; bfloat16 over
// several blocks); a bfloat16 expert of one block is the library's one product, rounded by it
// (as the grouped path's weight gradient).
template <typename T>
class WeightGradient {
 public:
  WeightGradient(T* out, int64_t size, int64_t blocks, std::vector<Acc<T>>& scratch)
      : out_(out), size_(size), widened_(out && !std::is_same_v<T, Acc<T>> && (blocks > 1 || kWidened<T>)) {
    if (widened_) scratch.resize(size), sum_ = scratch.data();
  }
  // Adds block `block`'s product (the first one overwrites).
  Status add(GemmCall c, int64_t block) {
    if (!widened_) {
      c.out_dtype = dtype_of<T>(), c.c = out_, c.accumulate = block > 0;
      return multiply(c);
    }
    return multiply_acc<T>(c, sum_, block > 0);
  }
  void finish() {
    if (widened_) convert(sum_, dtype_of<Acc<T>>(), out_, dtype_of<T>(), size_);
  }

 private:
  T* out_;
  int64_t size_;
  bool widened_;
  Acc<T>* sum_ = nullptr;
};

// fn(r) for each row r of a block of n rows of `width` values: on all threads when the block
// runs alone (outside a team), else on the calling thread. Each row is one thread's, in a fixed
// order, so the bits are the same either way.
template <typename Fn>
void for_rows(int64_t n, int64_t width, Fn fn) {
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && parallel_rows(n, width))
  for (int64_t r = 0; r < n; ++r) fn(r);
}

// sum[c] += rows[r][c] over the n rows in order, widened (a bias gradient), columns split as for_rows splits
// rows.
template <typename A, typename V>
void add_rows(const V* rows, int64_t n, int64_t width, std::vector<A>& sum) {
  for_rows(width, n, [&](int64_t c) {
    for (int64_t r = 0; r < n; ++r) sum[c] += widen(rows[r * width + c]);
  });
}

// rows[i] = the `width` values at source row row_of(i), in the GEMMs' type.
template <typename G, typename T, typename RowOf>
void gather(const T* source, int64_t width, int64_t n, RowOf row_of, std::vector<G>& rows) {
  rows.resize(n * width);
  if (width == 0) return;
  for_rows(n, width, [&](int64_t i) {
    const T* from = source + row_of(i) * width;
    if constexpr (std::is_same_v<G, T>)
      std::memcpy(rows.data() + i * width, from, width * sizeof(T));
    else
      convert(from, dtype_of<T>(), rows.data() + i * width, dtype_of<G>(), width);
  });
}

// The rows of T as GEMM operands: themselves, or float16's widened into `wide`.
template <typename T>
const GemmIn<T>* as_operand(const std::vector<T>& rows, std::vector<float>& wide) {
  if constexpr (kWidened<T>) {
    wide.resize(rows.size());
    convert(rows.data(), DType::f16, wide.data(), DType::f32, static_cast<int64_t>(rows.size()));
    return wide.data();
  } else {
    return rows.data();
  }
}

// The rows where as_operand(rows, wide) left them.
template <typename T>
const GemmIn<T>* operand(const std::vector<T>& rows, const std::vector<float>& wide) {
  if constexpr (kWidened<T>)
    return wide.data();
  else
    return rows.data();
}

// An expert's weight as the B operand of its blocks' GEMMs (one role: fc1's, fc2's):
// packed once for all of them (gemm.h's pack_b) when the expert has enough rows to pay
// for the packing, rather than by each block's GEMM.
class ExpertWeight {
 public:
  // For calls that differ from `call` only in m, a and c (call.m and call.a unused).
  void prepare(const GemmCall& call, int64_t rows) {
    packed_.reset();
    if (rows >= kMinPackedRows && call.k > 0 && call.n > 0) packed_ = pack_b(call, storage_);
  }
  GemmCall on(GemmCall call, int64_t m, const void* a) const {
    call.m = m, call.a = a, call.packed_b = packed_ ? &*packed_ : nullptr;
    return call;
  }

 private:
  std::vector<char> storage_;
  std::optional<PackedB> packed_;
};

// One thread's scratch, reused block after block; the backward reuses each buffer once the
// values in it are spent. dw_in, dw_out, w_in and w_out are an expert's, in the scratch of
// the thread that set the expert up (its blocks may run on other threads: run_blocks).
template <typename T>
struct Scratch {
  std::vector<GemmIn<T>> rows;  // token rows (forward); dout's rows, fc2's output gradient in their place,
                                // then the token rows (backward)
  std::vector<T> h, act;        // fc1's output (forward) or its gradient (backward), and the activation,
                                // stored as the composition stores them
  std::vector<Acc<T>> g;        // dout @ w_out^T
  std::vector<float> wide, wide_act, wide_dh;  // float16's float32 operands and results
  std::vector<Acc<T>> dw_in, dw_out;  // a 16-bit expert's weight gradients over several blocks
  ExpertWeight w_in, w_out;           // the expert's weights as the B of its blocks' GEMMs
};

// v rounded to T, as the GEMMs take it (float16's widened back).
template <typename T, typename A>
GemmIn<T> rounded(A v) {
  if constexpr (kWidened<T>)
    return widen(store<T>(v));
  else
    return store<T>(v);
}

template <typename T>
void activate(Activation kind, const T* h, int64_t n, int64_t in_features, std::vector<T>& out) {
  out.resize(n * activation_out_features(kind, in_features));
  ActivationArgs a;
  a.dtype = dtype_of<T>(), a.kind = kind, a.h = h, a.out = out.data(), a.rows = n,
  a.in_features = in_features;
  activation(a);
}

static_assert(kColumnChunk % kDotLanes == 0, "a chunk's columns keep their dot-product lanes");

// One block row's elementwise backward, from the row's pre-activation h (the saved one, read
// where it lies): the activation recomputed (into act, when given), the lane sums of
// dot(act, g) for dprobs (into partial, when given), and fc1's output gradient act'(h) times
// the slot's weight p times g (into dh, when given). A sigmoid-based kind computes one
// sigmoid per value for both (sigmoid_rows.h); the bits are those of activation() and
// activation_backward_at.
template <typename T>
void row_backward(Activation kind, const T* h, const Acc<T>* g, Acc<T> p, int64_t f_in, T* act, Acc<T>* partial,
                  T* dh) {
  using A = Acc<T>;
  const int64_t f = activation_out_features(kind, f_in);
  auto add_lanes = [&](int64_t c0, int64_t n) {  // column c adds to lane c % kDotLanes, in column order
    for (int64_t i0 = 0; i0 < n; i0 += kDotLanes)  // (dot_lane_partial's order)
      for (int64_t l = 0; l < std::min<int64_t>(kDotLanes, n - i0); ++l)
        partial[l] = add_product(partial[l], load<A>(act, c0 + i0 + l), g[c0 + i0 + l]);
  };
  const bool sigmoid_based =
      for_sigmoid_chunks(kind, h, f, [&](auto kind_constant, int64_t c0, int64_t n, const A* up, const A* sig) {
        if (act) forward_chunk(kind_constant, h, c0, n, up, sig, act);
        if (partial) add_lanes(c0, n);
        auto dy = [&](int64_t i) { return product(p, g[c0 + i]); };  // the activation's gradient: p times g
        if (dh) backward_chunk(kind_constant, h, f, c0, n, up, sig, dy, dh);
      });
  if (sigmoid_based) return;
  for (int64_t c = 0; c < f; ++c) {
    const A x = load<A>(h, c);
    if (act) act[c] = store<T>(activation_forward(kind, x, A(0)));
    if (dh) dh[c] = store<T>(activation_backward_at(kind, product(p, g[c]), x, A(0)).dx);
  }
  if (partial) add_lanes(0, f);
}

// Runs fn(item) for items [0, count) side by side on the threads, each on one thread.
template <typename Fn>
Status side_by_side(int64_t count, int threads, Fn fn) {
  std::vector<Status> status(count, Status::Ok());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
  for (int64_t i = 0; i < count; ++i) status[i] = fn(i);
  for (const Status& s : status)
    if (!s.ok()) return s;
  return Status::Ok();
}

// The team the call's experts share: float64 (OpenBLAS, a test dtype) runs them one after
// another, as the grouped path runs its GEMMs (gemm_threading).
int call_threads(DType dtype) { return omp_in_parallel() || dtype == DType::f64 ? 1 : omp_get_max_threads(); }

// Whether the library may split each of these GEMMs across threads (gemm_threading).
bool library_splits(std::initializer_list<GemmCall> calls) {
  return std::all_of(calls.begin(), calls.end(), [](const GemmCall& c) { return gemm_threading(c) == Threading::any; });
}

// An expert's blocks: part(b, s) then in_order(b, s) for each block b, with s a thread's
// scratch. Without a team, in order on the calling thread (s: own). With one (every
// thread's scratch), the blocks side by side, one thread each, and each in_order after the
// block before's, on the thread that did its part. Either way each block's calls are the
// same, one thread's, and its sums are added in block order: the same bits.
template <typename T, typename Part, typename InOrder>
Status run_blocks(int64_t count, Scratch<T>& own, std::vector<Scratch<T>>* team, Part part, InOrder in_order) {
  if (!team) {
    for (int64_t b = 0; b < count; ++b) {
      GG_RETURN_IF_ERROR(part(b, own));
      GG_RETURN_IF_ERROR(in_order(b, own));
    }
    return Status::Ok();
  }
  std::vector<Status> status(count, Status::Ok());
#pragma omp parallel for ordered schedule(static, 1) num_threads(static_cast<int>(team->size()))
  for (int64_t b = 0; b < count; ++b) {
    Scratch<T>& s = (*team)[omp_get_thread_num()];
    status[b] = part(b, s);
#pragma omp ordered
    {
      if (status[b].ok()) status[b] = in_order(b, s);
    }
  }
  for (const Status& s : status)
    if (!s.ok()) return s;
  return Status::Ok();
}

// fn(e, own, team) for every expert, each expert's blocks in order on one thread (team
// null) or, for the largest when thread_plan.h says so (skewed routing), alone on all
// threads first; the rest side by side, one thread each, largest first. An expert alone
// has its GEMMs split across the threads by the library where `splits` (library_splits of
// its GEMMs), else its blocks side by side (team: every thread's scratch); own is the
// scratch of the thread that sets it up.
template <typename T, typename Fn>
Status for_each_expert(const Routing& routing, int64_t experts, DType dtype, bool splits, Fn fn) {
  std::vector<int64_t> order(experts);
  for (int64_t e = 0; e < experts; ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return routing.rows(x).rows() > routing.rows(y).rows(); });
  std::vector<double> work;
  for (int64_t e : order) work.push_back(static_cast<double>(routing.rows(e).rows()));
  const int threads = call_threads(dtype);
  const size_t alone = gemms_run_alone(work, threads);
  std::vector<Scratch<T>> scratch(threads);
  for (size_t i = 0; i < alone; ++i) GG_RETURN_IF_ERROR(fn(order[i], scratch[0], splits ? nullptr : &scratch));
  return side_by_side(experts - static_cast<int64_t>(alone), threads,
                      [&](int64_t i) { return fn(order[alone + i], scratch[omp_get_thread_num()], nullptr); });
}

// ---- the forward ------------------------------------------------------------------------

template <typename T>
Status forward(const ExpertMlpArgs& a, int64_t block_rows) {
  using G = GemmIn<T>;
  const int64_t k = a.top_k, hidden = a.hidden, f_in = a.in_features, experts = a.num_experts;
  const int64_t f = activation_out_features(a.activation, f_in);
  const Routing routing(a);
  const GemmOperand<T> w_in(a.w_in, experts * hidden * f_in), w_out(a.w_out, experts * f * hidden),
      b_in(a.b_in, experts * f_in), b_out(a.b_out, experts * hidden);
  const T* tokens = static_cast<const T*>(a.tokens);
  T* h = static_cast<T*>(a.h);
  const RowScratch scratch_rows(routing.kept * hidden * int64_t(sizeof(T)));  // the expert outputs
  T* expert_rows = scratch_rows.as<T>();
  if (h) {  // fc1's output, advised as the grouped GEMMs' outputs are (huge_pages.h)
    advise_huge_pages(h, a.num_tokens * k * f_in * int64_t(sizeof(T)));
    for (int64_t s = 0; s < a.num_tokens * k; ++s)  // a dropped slot's pre-activation: exact zeros
      if (routing.row_map[s] < 0) std::memset(h + s * f_in, 0, f_in * sizeof(T));
  }

  auto calls = [&](int64_t e) {  // fc1's and fc2's, but for their rows
    return std::pair{gemm_call<G>(0, f_in, hidden, nullptr, false, w_in.at(e * hidden * f_in), a.transpose_rhs,
                                  b_in.at(e * f_in)),
                     gemm_call<G>(0, hidden, f, nullptr, false, w_out.at(e * f * hidden), a.transpose_rhs,
                                  b_out.at(e * hidden))};
  };
  const bool splits = library_splits({calls(0).first, calls(0).second});
  auto expert_outputs = [&](int64_t e, Scratch<T>& own, std::vector<Scratch<T>>* team) -> Status {
    const RowRange rows = routing.rows(e);
    const auto [fc1, fc2] = calls(e);
    own.w_in.prepare(fc1, rows.rows()), own.w_out.prepare(fc2, rows.rows());
    const int64_t count = block_count(rows, block_rows), step = block_step(block_rows, rows.rows(), count);
    auto block_outputs = [&](int64_t b, Scratch<T>& s) -> Status {
      const RowRange block = block_of(rows, b, count, step);
      const int64_t n = block.rows();
      const int32_t* slots = routing.slot_of_row.data() + block.begin;
      gather<G>(tokens, hidden, n, [&](int64_t r) { return slots[r] / k; }, s.rows);
      s.h.resize(n * f_in);
      GG_RETURN_IF_ERROR(multiply_into(own.w_in.on(fc1, n, s.rows.data()), s.h.data(), s.wide));
      if (h && f_in > 0)
        for_rows(n, f_in,
                 [&](int64_t r) { std::memcpy(h + slots[r] * f_in, s.h.data() + r * f_in, f_in * sizeof(T)); });
      activate(a.activation, s.h.data(), n, f_in, s.act);
      return multiply_into(own.w_out.on(fc2, n, as_operand(s.act, s.wide_act)), expert_rows + block.begin * hidden,
                           s.wide);
    };
    return run_blocks(count, own, team, block_outputs, [](int64_t, Scratch<T>&) { return Status::Ok(); });
  };
  GG_RETURN_IF_ERROR(for_each_expert<T>(routing, experts, a.dtype, splits, expert_outputs));

  UnpermuteArgs sum;  // out[t]: its slots' weighted expert outputs, in slot order
  sum.dtype = a.dtype, sum.probs_dtype = a.probs_dtype;
  sum.permuted = expert_rows, sum.row_map = routing.row_map.data(), sum.probs = a.probs, sum.out = a.out;
  sum.num_rows = routing.kept, sum.num_tokens = a.num_tokens, sum.top_k = k, sum.hidden = hidden;
  return unpermute(sum);
}

// ---- the backward -----------------------------------------------------------------------

template <typename T, typename P>
Status backward(const ExpertMlpBackwardArgs& a, int64_t block_rows) {
  using G = GemmIn<T>;
  using A = Acc<T>;
  const int64_t k = a.top_k, hidden = a.hidden, f_in = a.in_features, experts = a.num_experts;
  const int64_t f = activation_out_features(a.activation, f_in);
  const Routing routing(a);
  const GemmOperand<T> w_in(a.w_in, experts * hidden * f_in), w_out(a.w_out, experts * f * hidden);
  const T* dout = static_cast<const T*>(a.dout);
  const T* tokens = static_cast<const T*>(a.tokens);
  const T* h = static_cast<const T*>(a.h);
  const T* b_out = static_cast<const T*>(a.b_out);
  const P* probs = static_cast<const P*>(a.probs);
  P* dprobs = static_cast<P*>(a.dprobs);
  const RowScratch scratch_rows(a.dtokens ? routing.kept * hidden * int64_t(sizeof(T)) : 0);
  T* token_rows = scratch_rows.as<T>();  // the input gradients' rows
  const bool want_dw_in = a.dw_in || a.db_in, want_dh = a.dtokens || want_dw_in;
  const bool want_g = want_dh || a.dprobs, want_dy = a.dw_out || a.db_out, want_act = a.dprobs || a.dw_out;
  if (dprobs)
    for (int64_t s = 0; s < a.num_tokens * k; ++s)
      if (routing.row_map[s] < 0) dprobs[s] = P{};  // a dropped slot's weight has no effect
  if (a.dw_in) advise_huge_pages(a.dw_in, experts * hidden * f_in * int64_t(sizeof(T)));  // as the grouped
  if (a.dw_out) advise_huge_pages(a.dw_out, experts * f * hidden * int64_t(sizeof(T)));   // weight gradients

  // g = dout @ w_out^T (accumulated in Acc<T>) and the input gradients dh @ w_in: the
  // weights are their B; and the weight gradients' calls, but for their rows.
  auto calls = [&](int64_t e) {
    GemmCall g = gemm_call<G>(0, f, hidden, nullptr, false, w_out.at(e * f * hidden), !a.transpose_rhs);
    g.out_dtype = dtype_of<A>();
    return std::pair{g, gemm_call<G>(0, hidden, f_in, nullptr, false, w_in.at(e * hidden * f_in), !a.transpose_rhs)};
  };
  const GemmCall weight_gradient = gemm_call<G>(0, 0, 0, nullptr, true, nullptr, false);
  const bool splits = library_splits({calls(0).first, calls(0).second, weight_gradient});

  auto expert_gradients = [&](int64_t e, Scratch<T>& own, std::vector<Scratch<T>>* team) -> Status {
    const RowRange rows = routing.rows(e);
    const int64_t w_in_size = hidden * f_in, w_out_size = f * hidden;
    T* dw_in = a.dw_in ? static_cast<T*>(a.dw_in) + e * w_in_size : nullptr;
    T* dw_out = a.dw_out ? static_cast<T*>(a.dw_out) + e * w_out_size : nullptr;
    T* db_in = a.db_in ? static_cast<T*>(a.db_in) + e * f_in : nullptr;
    T* db_out = a.db_out ? static_cast<T*>(a.db_out) + e * hidden : nullptr;
    if (rows.rows() == 0) {  // an expert without slots: exact-zero gradients, no GEMM
      if (dw_in) std::memset(dw_in, 0, w_in_size * sizeof(T));
      if (dw_out) std::memset(dw_out, 0, w_out_size * sizeof(T));
      if (db_in) std::memset(db_in, 0, f_in * sizeof(T));
      if (db_out) std::memset(db_out, 0, hidden * sizeof(T));
      return Status::Ok();
    }
    const int64_t count = block_count(rows, block_rows), step = block_step(block_rows, rows.rows(), count);
    WeightGradient<T> dw_in_sum(dw_in, w_in_size, count, own.dw_in),
        dw_out_sum(dw_out, w_out_size, count, own.dw_out);
    std::vector<A> db_in_acc(db_in ? f_in : 0, A(0)), db_out_acc(db_out ? hidden : 0, A(0));
    const auto [g_call, dx_call] = calls(e);
    own.w_out.prepare(g_call, want_g ? rows.rows() : 0), own.w_in.prepare(dx_call, a.dtokens ? rows.rows() : 0);
    auto block = [&](int64_t b) { return block_of(rows, b, count, step); };
    auto slots = [&](int64_t b) { return routing.slot_of_row.data() + block(b).begin; };

    // A block's rows (any thread): g, the pass per row, and the input gradients.
    auto row_gradients = [&](int64_t b, Scratch<T>& s) -> Status {
      const int64_t n = block(b).rows();
      const int32_t* slot = slots(b);
      gather<G>(dout, hidden, n, [&](int64_t r) { return slot[r] / k; }, s.rows);
      if (want_dh) s.h.resize(n * f_in);
      if (want_g) {  // g = dout @ w_out^T, unweighted: fc2's input gradient over the slot's weight
        s.g.resize(n * f);
        GG_RETURN_IF_ERROR(multiply_acc<T>(own.w_out.on(g_call, n, s.rows.data()), s.g.data(), false));
      }
      if (want_act) s.act.resize(n * f);
      for_rows(n, f_in + hidden, [&](int64_t r) {
        const A p = probs ? load<A>(probs, slot[r]) : A(1);
        A partial[kDotLanes] = {};
        row_backward<T>(a.activation, h + slot[r] * f_in, want_g ? s.g.data() + r * f : nullptr, p, f_in,
                        want_act ? s.act.data() + r * f : nullptr, dprobs ? partial : nullptr,
                        want_dh ? s.h.data() + r * f_in : nullptr);
        G* dout_row = s.rows.data() + r * hidden;
        if (dprobs) {
          A dot = fold_dot_lanes(partial);
          if (b_out) {
            auto bias = [&](int64_t c) { return load<A>(b_out, e * hidden + c); };
            auto grad = [&](int64_t c) { return load<A>(dout_row, c); };
            for (int lane = 0; lane < kDotLanes; ++lane)
              partial[lane] = dot_lane_partial<A>(lane, hidden, bias, grad);
            dot = dot + fold_dot_lanes(partial);
          }
          dprobs[slot[r]] = store<P>(dot);
        }
        if (want_dy)  // fc2's output gradient in place of dout's row: the slot's weight times dout[t],
                      // rounded as unpermute's backward rounds it
          for (int64_t c = 0; c < hidden; ++c) dout_row[c] = rounded<T>(product(p, load<A>(dout_row, c)));
      });
      if (!want_dh) return Status::Ok();
      const G* dh = as_operand(s.h, s.wide_dh);  // float16's widened once, for w_in's gradient too
      if (!a.dtokens) return Status::Ok();
      // the rows' input gradients; each token sums its own below
      return multiply_into(own.w_in.on(dx_call, n, dh), token_rows + block(b).begin * hidden, s.wide);
    };

    // Its weight and bias gradients' terms (in block order).
    auto add_terms = [&](int64_t b, Scratch<T>& s) -> Status {
      const int64_t n = block(b).rows();
      const int32_t* slot = slots(b);
      if (want_dy) {
        const G* act = as_operand(s.act, s.wide_act);
        if (dw_out)
          GG_RETURN_IF_ERROR(dw_out_sum.add(a.transpose_rhs
                                                ? gemm_call<G>(hidden, f, n, s.rows.data(), true, act, false)
                                                : gemm_call<G>(f, hidden, n, act, true, s.rows.data(), false),
                                            b));
        if (db_out) add_rows(s.rows.data(), n, hidden, db_out_acc);  // rows in order, as grouped_bias_grad
      }
      if (dw_in) {
        const G* dh = operand(s.h, s.wide_dh);
        gather<G>(tokens, hidden, n, [&](int64_t r) { return slot[r] / k; }, s.rows);
        GG_RETURN_IF_ERROR(dw_in_sum.add(a.transpose_rhs
                                             ? gemm_call<G>(f_in, hidden, n, dh, true, s.rows.data(), false)
                                             : gemm_call<G>(hidden, f_in, n, s.rows.data(), true, dh, false),
                                         b));
      }
      if (db_in) add_rows(s.h.data(), n, f_in, db_in_acc);
      return Status::Ok();
    };

    GG_RETURN_IF_ERROR(run_blocks(count, own, team, row_gradients, add_terms));
    dw_in_sum.finish(), dw_out_sum.finish();
    if (db_in) convert(db_in_acc.data(), dtype_of<A>(), db_in, a.dtype, f_in);
    if (db_out) convert(db_out_acc.data(), dtype_of<A>(), db_out, a.dtype, hidden);
    return Status::Ok();
  };

  GG_RETURN_IF_ERROR(for_each_expert<T>(routing, experts, a.dtype, splits, expert_gradients));

  if (!a.dtokens) return Status::Ok();
  UnpermuteArgs sum;  // dtokens[t]: its slots' input gradients, in slot order
  sum.dtype = a.dtype, sum.permuted = token_rows, sum.row_map = routing.row_map.data(), sum.out = a.dtokens;
  sum.num_rows = routing.kept, sum.num_tokens = a.num_tokens, sum.top_k = k, sum.hidden = hidden;
  return unpermute(sum);
}

}  // namespace

Status expert_mlp_in_blocks(const ExpertMlpArgs& a, int64_t block_rows) {
  return visit_dtype(a.dtype, [&](auto tag) { return forward<decltype(tag)>(a, block_rows); });
}

Status expert_mlp_backward_in_blocks(const ExpertMlpBackwardArgs& a, int64_t block_rows) {
  return visit_values_and_probs(a.dtype, a.probs || a.dprobs ? a.probs_dtype : a.dtype, [&](auto v, auto p) {
    return backward<decltype(v), decltype(p)>(a, block_rows);
  });
}

Status expert_mlp(const ExpertMlpArgs& a) {
  return expert_mlp_in_blocks(a, rows_per_block(a.hidden, dtype_size(a.dtype)));
}

Status expert_mlp_backward(const ExpertMlpBackwardArgs& a) {
  return expert_mlp_backward_in_blocks(a, rows_per_block(a.hidden, dtype_size(a.dtype)));
}

}  // namespace cpu
}  // namespace groupgemm
