// Core tests of the fused expert MLP (groupgemm/expert_mlp.h), built under AddressSanitizer
// + UndefinedBehaviorSanitizer: the routing's window and its chunk-count invariance; the
// CPU backend's forward and backward in every dtype against a naive double-precision
// reference (biases, both weight layouts, windows, dropped slots, idle experts, empty
// sizes); bit equality with the composition (permute, grouped GEMMs, activation,
// unpermute) where the same kernels run; the same bits on any thread count; the checks.
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backends.h"
#include "check.h"
#include "convert.h"
#include "expert_mlp_host_launcher.h"
#include "expert_mlp_sequence.h"
#include "expert_mlp_workspace.h"
#include "groupgemm/activation.h"
#include "groupgemm/expert_mlp.h"
#include "groupgemm/groupgemm.h"
#include "row_scratch.h"

using namespace groupgemm;
using namespace groupgemm_tests;

namespace {

// ---- the routing ------------------------------------------------------------------------

void test_window_bucket() {
  g_case = "window_bucket";
  const int64_t big = std::numeric_limits<int64_t>::max(), small = std::numeric_limits<int64_t>::min();
  CHECK(window_bucket(0, 0, 4) == 0 && window_bucket(3, 0, 4) == 3 && window_bucket(4, 0, 4) == 4);
  CHECK(window_bucket(-1, 0, 4) == 4);  // the dropped marker
  CHECK(window_bucket(5, 4, 2) == 1 && window_bucket(3, 4, 2) == 2 && window_bucket(6, 4, 2) == 2);
  CHECK(window_bucket(-1, -2, 4) == 4);  // a negative id stays dropped inside a window that covers it
  CHECK(window_bucket(1, -2, 4) == 3);
  CHECK(window_bucket(big, small, 4) == 4 && window_bucket(big, big - 1, 4) == 1);  // no overflow
  CHECK(window_bucket(0, big, 4) == 4 && window_bucket(2, 0, 0) == 0);
}

// The routing gives permute's rows for the window [0, E), on any chunk count; a window
// elsewhere gives the rows of the ids inside it.
void test_routing_steps() {
  g_case = "routing_steps";
  std::mt19937 rng(3);
  std::uniform_int_distribution<int64_t> id(-2, 9);
  const int64_t t = 37, k = 3, slots = t * k;
  std::vector<int64_t> ids(slots);
  for (auto& v : ids) v = id(rng);
  const IndexArray idx{ids.data(), IndexType::i64, slots};
  for (int64_t offset : {0, 3, -1}) {
    const int64_t e = 5;
    std::vector<int32_t> base_map, base_rows, base_start;
    for (int64_t chunks : {1, 3, 256}) {
      std::vector<int32_t> counts(count_entries(e, chunks)), start(e + 1), row_map(slots),
          slot_of_row(slots, -7);
      const IndexArray offset_array{&offset, IndexType::i64, 1};
      const int64_t kept = expert_routing_on_host(idx, slots, offset_array, e, chunks, counts.data(),
                                                  start.data(), row_map.data(), slot_of_row.data());
      int64_t want_kept = 0;
      for (int64_t s = 0; s < slots; ++s) want_kept += window_bucket(ids[s], offset, e) < e;
      CHECK(kept == want_kept);
      for (int64_t s = 0; s < slots; ++s) {  // rows ascend by expert, then by slot
        const int64_t b = window_bucket(ids[s], offset, e);
        if (b == e) {
          CHECK(row_map[s] == -1);
          continue;
        }
        int64_t before = 0;
        for (int64_t o = 0; o < slots; ++o) {
          const int64_t ob = window_bucket(ids[o], offset, e);
          before += ob < b || (ob == b && o < s);
        }
        CHECK(row_map[s] == before && slot_of_row[row_map[s]] == s);
        CHECK(row_map[s] >= expert_rows(start.data(), b).begin &&
              row_map[s] < expert_rows(start.data(), b).end);
      }
      if (chunks == 1) {
        base_map = row_map, base_rows.assign(slot_of_row.begin(), slot_of_row.begin() + kept),
        base_start = start;
      } else {
        CHECK(row_map == base_map && start == base_start);
        CHECK(std::equal(base_rows.begin(), base_rows.end(), slot_of_row.begin()));
      }
    }
  }
  CHECK(block_count({3, 3}, 64) == 0 && block_count({0, 64}, 64) == 1 && block_count({10, 139}, 64) == 3);
  const RowRange blocks[] = {block_of({10, 139}, 0, 3), block_of({10, 139}, 1, 3), block_of({10, 139}, 2, 3)};
  CHECK(blocks[0].begin == 10 && blocks[0].end == 53 && blocks[1].end == 96 && blocks[2].begin == 96);
  CHECK(blocks[2].end == 139 && blocks[2].rows() == 43);
  // In whole steps: 1030 rows, at most 1024 a block, steps of 64: 512 rows, then 512 + 6.
  const RowRange stepped[] = {block_of({0, 1030}, 0, 2, 64), block_of({0, 1030}, 1, 2, 64)};
  CHECK(stepped[0].begin == 0 && stepped[0].end == 512 && stepped[1].begin == 512 && stepped[1].end == 1030);
  // 19457 rows in 20 blocks: 304 steps, the first 4 blocks 16 of them, the others 15, the
  // last row with the last block (not a block of one row).
  CHECK(block_of({0, 19457}, 3, 20, 64).rows() == 1024 && block_of({0, 19457}, 4, 20, 64).rows() == 960);
  CHECK(block_of({0, 19457}, 19, 20, 64).rows() == 961 && block_of({0, 19457}, 19, 20, 64).end == 19457);
  // An expert without rows shares its start with the next one: a row belongs to the last
  // expert starting at or before it.
  const int32_t starts[] = {0, 0, 3, 3, 5};
  CHECK(expert_of_row(starts, 4, 0) == 1 && expert_of_row(starts, 4, 2) == 1);
  CHECK(expert_of_row(starts, 4, 3) == 3 && expert_of_row(starts, 4, 4) == 3);
  CHECK(expert_of_row(starts, 1, 0) == 0);
}

// The CUDA workspace: every region 16-byte aligned, in order, none overlapping the next,
// the row scratch sized by the call (the backward's two more), and the size the API reports.
void test_cuda_workspace_layout() {
  g_case = "cuda_workspace_layout";
  for (int64_t s : {0, 1, 4096})
    for (int64_t e : {0, 1, 300})
      for (bool backward : {false, true}) {
        const int64_t h = 8, f_in = 12, f = 6, bytes = 2;
        const ExpertMlpLayout l = expert_mlp_layout({s, e, h, f_in, f, bytes, backward});
        std::vector<std::pair<int64_t, int64_t>> regions = {
            {l.kept_rows, 4},       {l.bucket_start, (e + 1) * 4}, {l.counts, count_entries(e, l.chunks) * 4},
            {l.row_map, s * 4},     {l.slot_of_row, s * 4},        {l.token_of_row, s * 4}};
        for (int set = 0; set < kExpertGemmSets; ++set) {
          const GemmArraysLayout& g = l.gemm[set];
          regions.push_back({g.action, e * 4});
          regions.push_back({g.problem, e * 12});
          for (int i = 0; i < 4; ++i) regions.push_back({g.ptr[i], e * 8});
          for (int i = 0; i < 4; ++i) regions.push_back({g.ld[i], e * 8});
          regions.push_back({l.gather[set], e * 8});
        }
        regions.push_back({l.fc1_rows, s * f_in * bytes});
        regions.push_back({l.act_rows, s * f * bytes});
        regions.push_back({l.grad_rows, backward ? s * f * 4 : 0});
        regions.push_back({l.dy_rows, backward ? s * h * bytes : 0});
        regions.push_back({l.bytes, 0});
        for (size_t i = 0; i + 1 < regions.size(); ++i)
          CHECK(regions[i].first % 16 == 0 && regions[i + 1].first >= regions[i].first + regions[i].second);
        const Activation swiglu = Activation::swiglu;
        CHECK(expert_mlp_workspace_bytes(Device::cuda, s, e, h, f_in, swiglu, bytes, backward) == l.bytes);
        CHECK(expert_mlp_workspace_bytes(Device::cpu, s, e, h, f_in, swiglu, bytes, backward) == 0);
      }
}

// ---- the CPU backend against a double-precision reference ------------------------------

template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, double>)
    return DType::f64;
  else if constexpr (std::is_same_v<T, cpu::bf16_t>)
    return DType::bf16;
  else if constexpr (std::is_same_v<T, cpu::f16_t>)
    return DType::f16;
  else
    return DType::f32;
}

template <typename T>
double to_double(T v) {
  return static_cast<double>(cpu::widen(v));
}

template <typename T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, double>)
    return v;
  else
    return cpu::narrow<T>(static_cast<float>(v));
}

template <typename T>
std::vector<T> random_values(int64_t n, std::mt19937& rng, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = from_double<T>(d(rng));
  return v;
}

double tolerance(DType t) {
  switch (t) {
    case DType::f64: return 1e-11;
    case DType::f32: return 2e-5;
    case DType::f16: return 4e-3;
    case DType::bf16: return 3e-2;
  }
  return 0;
}

struct Case {
  const char* name;
  int64_t tokens, top_k, hidden, f_in, experts;
  Activation activation;
  bool bias, transpose, probs;
  int64_t offset;  // group_offset; -100: absent
  int64_t max_id;  // ids are drawn from [-1, max_id]
};

// The problem's arrays, in T, and its reference results in double.
template <typename T>
struct Problem {
  Case c;
  int64_t f;
  std::vector<T> tokens, w_in, w_out, b_in, b_out, dout;
  std::vector<float> probs;
  std::vector<int64_t> ids;
  int64_t offset_value;

  Problem(const Case& c, unsigned seed) : c(c), f(activation_out_features(c.activation, c.f_in)) {
    std::mt19937 rng(seed);
    tokens = random_values<T>(c.tokens * c.hidden, rng);
    w_in = random_values<T>(c.experts * c.hidden * c.f_in, rng, 0.5);
    w_out = random_values<T>(c.experts * f * c.hidden, rng, 0.5);
    if (c.bias)
      b_in = random_values<T>(c.experts * c.f_in, rng), b_out = random_values<T>(c.experts * c.hidden, rng);
    dout = random_values<T>(c.tokens * c.hidden, rng);
    std::uniform_real_distribution<float> p(0.f, 1.f);
    std::uniform_int_distribution<int64_t> id(-1, c.max_id);
    for (int64_t s = 0; s < c.tokens * c.top_k; ++s) probs.push_back(p(rng)), ids.push_back(id(rng));
    offset_value = c.offset == -100 ? 0 : c.offset;
  }
  int64_t local(int64_t s) const { return window_bucket(ids[s], offset_value, c.experts); }
  double win(int64_t e, int64_t i, int64_t j) const {  // w_in[e] as [H, F_in]
    return to_double(c.transpose ? w_in[(e * c.f_in + j) * c.hidden + i]
                                 : w_in[(e * c.hidden + i) * c.f_in + j]);
  }
  double wout(int64_t e, int64_t i, int64_t j) const {  // w_out[e] as [F, H]
    return to_double(c.transpose ? w_out[(e * c.hidden + j) * f + i] : w_out[(e * f + i) * c.hidden + j]);
  }
  int64_t win_index(int64_t e, int64_t i, int64_t j) const {
    return c.transpose ? (e * c.f_in + j) * c.hidden + i : (e * c.hidden + i) * c.f_in + j;
  }
  int64_t wout_index(int64_t e, int64_t i, int64_t j) const {
    return c.transpose ? (e * c.hidden + j) * f + i : (e * f + i) * c.hidden + j;
  }
};

struct Reference {
  std::vector<double> out, h, dtokens, dprobs, dw_in, dw_out, db_in, db_out;
};

template <typename T>
Reference reference(const Problem<T>& p) {
  const Case& c = p.c;
  const int64_t hd = c.hidden, fi = c.f_in, f = p.f, k = c.top_k;
  Reference r;
  r.out.assign(c.tokens * hd, 0), r.h.assign(c.tokens * k * fi, 0), r.dtokens.assign(c.tokens * hd, 0);
  r.dprobs.assign(c.tokens * k, 0), r.dw_in.assign(p.w_in.size(), 0), r.dw_out.assign(p.w_out.size(), 0);
  r.db_in.assign(c.experts * fi, 0), r.db_out.assign(c.experts * hd, 0);
  for (int64_t s = 0; s < c.tokens * k; ++s) {
    const int64_t e = p.local(s), t = s / k;
    if (e == c.experts) continue;
    const double prob = c.probs ? p.probs[s] : 1.0;
    std::vector<double> h(fi), a(f), y(hd), g(f), dh(fi);
    for (int64_t j = 0; j < fi; ++j) {
      h[j] = c.bias ? to_double(p.b_in[e * fi + j]) : 0.0;
      for (int64_t i = 0; i < hd; ++i) h[j] += to_double(p.tokens[t * hd + i]) * p.win(e, i, j);
      r.h[s * fi + j] = h[j];
    }
    const int64_t up = c.activation == Activation::swiglu ? f : 0;
    for (int64_t j = 0; j < f; ++j)
      a[j] = activation_forward<double>(c.activation, h[j], up ? h[up + j] : 0.0);
    for (int64_t i = 0; i < hd; ++i) {
      y[i] = c.bias ? to_double(p.b_out[e * hd + i]) : 0.0;
      for (int64_t j = 0; j < f; ++j) y[i] += a[j] * p.wout(e, j, i);
      r.out[t * hd + i] += prob * y[i];
      r.dprobs[s] += y[i] * to_double(p.dout[t * hd + i]);
    }
    for (int64_t j = 0; j < f; ++j) {
      g[j] = 0;
      for (int64_t i = 0; i < hd; ++i) g[j] += prob * to_double(p.dout[t * hd + i]) * p.wout(e, j, i);
      const ActivationGrad<double> d =
          activation_backward_at<double>(c.activation, g[j], h[j], up ? h[up + j] : 0.0);
      dh[j] = d.dx;
      if (up) dh[up + j] = d.dup;
    }
    for (int64_t i = 0; i < hd; ++i) {
      const double dy = prob * to_double(p.dout[t * hd + i]);
      r.db_out[e * hd + i] += dy;
      for (int64_t j = 0; j < f; ++j) r.dw_out[p.wout_index(e, j, i)] += a[j] * dy;
    }
    for (int64_t j = 0; j < fi; ++j) {
      r.db_in[e * fi + j] += dh[j];
      for (int64_t i = 0; i < hd; ++i) {
        r.dw_in[p.win_index(e, i, j)] += to_double(p.tokens[t * hd + i]) * dh[j];
        r.dtokens[t * hd + i] += dh[j] * p.win(e, i, j);
      }
    }
  }
  return r;
}

// Results of the fused op in T (dprobs in float32).
template <typename T>
struct Fused {
  std::vector<T> out, h, dtokens, dw_in, dw_out, db_in, db_out;
  std::vector<float> dprobs;
};

// The CUDA backend's call sequence on the host, over a workspace of the size it asks for,
// filled with 0xFF bytes (NaN in every float dtype) so a row read before it is written shows.
template <typename Args, typename Enqueue>
Status run_cuda_sequence(const Args& a, bool backward, Enqueue enqueue,
                         emulated::ExpertHostLauncher& launch) {
  const int64_t bytes = expert_mlp_layout(shape_of(a, backward)).bytes;
  std::vector<int64_t> workspace((bytes + 7) / 8, -1);
  return enqueue(a, workspace.data(), launch);
}

// One CPU call with the CPU backend's kept scratch rows (row_scratch.h) poisoned first.
template <typename Call>
void run_cpu(Call call) {
  cpu::poison_kept_row_scratch();
  CHECK(call().ok());
}

// block_rows 0: the public entry points (the CPU's own blocks); else blocks of at most that many rows.
// With `cuda`, the CUDA backend's call sequence on the host instead. The scratch rows are NaN
// before each call: the caller's, and the CPU backend's own (row_scratch.h), which it uses instead.
template <typename T>
Fused<T> run_fused(const Problem<T>& p, int64_t block_rows = 0,
                   emulated::ExpertHostLauncher* cuda = nullptr) {
  const Case& c = p.c;
  const int64_t slots = c.tokens * c.top_k;
  Fused<T> r;
  const T nan = from_double<T>(std::nan(""));
  r.out.assign(c.tokens * c.hidden, nan), r.h.assign(slots * c.f_in, nan);
  std::vector<T> rows(slots * c.hidden, nan);
  ExpertMlpArgs a;
  a.dtype = dtype_of<T>(), a.probs_dtype = DType::f32, a.activation = c.activation;
  a.tokens = p.tokens.data(), a.expert_indices = {p.ids.data(), IndexType::i64, slots};
  a.probs = c.probs ? p.probs.data() : nullptr;
  a.w_in = p.w_in.data(), a.w_out = p.w_out.data();
  a.b_in = c.bias ? p.b_in.data() : nullptr, a.b_out = c.bias ? p.b_out.data() : nullptr;
  if (c.offset != -100) a.group_offset = {&p.offset_value, IndexType::i64, 1};
  a.out = r.out.data(), a.h = r.h.data(), a.expert_rows = rows.data();
  a.num_tokens = c.tokens, a.top_k = c.top_k, a.hidden = c.hidden, a.in_features = c.f_in,
  a.num_experts = c.experts;
  a.transpose_rhs = c.transpose;
  if (cuda)
    CHECK(run_cuda_sequence(a, false, enqueue_expert_mlp<emulated::ExpertHostLauncher>, *cuda).ok());
  else
    run_cpu([&] { return block_rows ? cpu::expert_mlp_in_blocks(a, block_rows) : expert_mlp(a, ExecContext{}); });

  r.dtokens.assign(c.tokens * c.hidden, nan), r.dprobs.assign(slots, std::nanf(""));
  r.dw_in.assign(p.w_in.size(), nan), r.dw_out.assign(p.w_out.size(), nan);
  r.db_in.assign(c.experts * c.f_in, nan), r.db_out.assign(c.experts * c.hidden, nan);
  ExpertMlpBackwardArgs b;
  b.dtype = a.dtype, b.probs_dtype = DType::f32, b.activation = c.activation;
  b.dout = p.dout.data(), b.tokens = a.tokens, b.expert_indices = a.expert_indices, b.probs = a.probs;
  b.w_in = a.w_in, b.w_out = a.w_out, b.b_out = a.b_out, b.group_offset = a.group_offset, b.h = r.h.data();
  b.dtokens = r.dtokens.data(), b.dprobs = r.dprobs.data(), b.dw_in = r.dw_in.data(),
  b.dw_out = r.dw_out.data();
  b.db_in = r.db_in.data(), b.db_out = r.db_out.data(), b.token_rows = rows.data();
  b.num_tokens = c.tokens, b.top_k = c.top_k, b.hidden = c.hidden, b.in_features = c.f_in,
  b.num_experts = c.experts;
  b.transpose_rhs = c.transpose;
  if (cuda)
    CHECK(run_cuda_sequence(b, true, enqueue_expert_mlp_backward<emulated::ExpertHostLauncher>, *cuda).ok());
  else
    run_cpu([&] {
      return block_rows ? cpu::expert_mlp_backward_in_blocks(b, block_rows) : expert_mlp_backward(b, ExecContext{});
    });
  return r;
}

// Largest error over the largest reference value (relative by the array's scale).
template <typename V>
bool close(const std::vector<V>& got, const std::vector<double>& want, double tol, const char* what) {
  double scale = 0, err = 0;
  bool finite = got.size() == want.size();
  for (size_t i = 0; i < want.size() && finite; ++i) {
    const double g = to_double(got[i]);
    finite = std::isfinite(g);
    scale = std::max(scale, std::fabs(want[i]));
    err = std::max(err, std::fabs(g - want[i]));
  }
  const bool ok = finite && err <= tol * std::max(scale, 1.0);
  if (!ok) std::printf("  %s: error %g, scale %g, finite %d\n", what, err, scale, finite);
  return ok;
}

template <typename T>
void check_results(const Problem<T>& p, const Fused<T>& got) {
  const Case& c = p.c;
  const Reference want = reference(p);
  const double tol = tolerance(dtype_of<T>()) * (c.f_in > 16 ? 2 : 1);
  CHECK(close(got.out, want.out, tol, "out"));
  CHECK(close(got.h, want.h, tol, "h"));
  CHECK(close(got.dtokens, want.dtokens, tol, "dtokens"));
  CHECK(close(got.dprobs, want.dprobs, std::max(tol, tolerance(DType::f32)), "dprobs"));  // stored in float32
  CHECK(close(got.dw_in, want.dw_in, tol, "dw_in"));
  CHECK(close(got.dw_out, want.dw_out, tol, "dw_out"));
  CHECK(close(got.db_in, want.db_in, tol, "db_in"));
  CHECK(close(got.db_out, want.db_out, tol, "db_out"));
  // Exact zeros: a dropped slot's h row and dprobs, an idle expert's gradients.
  for (int64_t s = 0; s < c.tokens * c.top_k; ++s)
    if (p.local(s) == c.experts) {
      CHECK(got.dprobs[s] == 0.0f);
      for (int64_t j = 0; j < c.f_in; ++j) CHECK(to_double(got.h[s * c.f_in + j]) == 0.0);
    }
  for (int64_t e = 0; e < c.experts; ++e) {
    bool idle = true;
    for (int64_t s = 0; s < c.tokens * c.top_k; ++s) idle = idle && p.local(s) != e;
    if (!idle) continue;
    const int64_t w_in_size = c.hidden * c.f_in, w_out_size = p.f * c.hidden;
    for (int64_t i = 0; i < w_in_size; ++i) CHECK(to_double(got.dw_in[e * w_in_size + i]) == 0.0);
    for (int64_t i = 0; i < w_out_size; ++i) CHECK(to_double(got.dw_out[e * w_out_size + i]) == 0.0);
    for (int64_t i = 0; i < c.f_in && c.bias; ++i) CHECK(to_double(got.db_in[e * c.f_in + i]) == 0.0);
  }
}

template <typename T>
void check_against_reference(const Case& c, int64_t block_rows = 0) {
  g_case = std::string(c.name) + " " + dtype_name(dtype_of<T>()) + " blocks of " + std::to_string(block_rows);
  const Problem<T> p(c, 11);
  check_results(p, run_fused(p, block_rows));
}

// The CUDA backend's call sequence (expert_mlp_sequence.h) executed on the host: the same
// results and exact zeros, GEMMs only over non-empty contractions, every gathered problem
// with its indices, and fills where a contraction is empty.
template <typename T>
void check_cuda_sequence(const Case& c) {
  g_case = std::string("cuda sequence ") + c.name + " " + dtype_name(dtype_of<T>());
  const Problem<T> p(c, 11);
  emulated::ExpertHostLauncher launch;
  check_results(p, run_fused(p, 0, &launch));
  const emulated::ExpertLaunchRecord& r = launch.record();
  CHECK(r.zero_k_problems == 0 && r.missing_indices == 0);
  const int64_t slots = c.tokens * c.top_k;
  if (slots > 0 && c.hidden > 0 && c.f_in > 0 && c.experts > 0)  // fc1, g and w_in's gradient: gathered
    CHECK(r.gathered_gemms == 3 && r.fills == 0);
  if (slots > 0 && (c.hidden == 0 || c.f_in == 0) && c.experts > 0) CHECK(r.fills > 0);
}

// ---- bits: the composition, thread counts -------------------------------------------------

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// permute over every id, the grouped MLP on the window, unpermute: out and db_out match the
// fused op's bits (the same GEMM kernels on the same rows, the same sums in the same order).
template <typename T>
void check_composition_bits(const Case& c) {
  g_case = std::string("composition ") + c.name + " " + dtype_name(dtype_of<T>());
  const Problem<T> p(c, 5);
  const Fused<T> fused = run_fused(p);
  const int64_t slots = c.tokens * c.top_k, hd = c.hidden, fi = c.f_in, f = p.f;
  const int64_t total = std::max<int64_t>(c.max_id + 1, p.offset_value + c.experts);
  const DType t = dtype_of<T>();
  const ExecContext cpu;
  std::vector<T> permuted(slots * hd), h(slots * fi), act(slots * f), y(slots * hd), out(c.tokens * hd);
  std::vector<int32_t> sizes(total), row_map(slots);
  PermuteArgs pa;
  pa.dtype = t, pa.tokens = p.tokens.data(), pa.expert_indices = {p.ids.data(), IndexType::i64, slots};
  pa.permuted = permuted.data(), pa.group_sizes = sizes.data(), pa.row_map = row_map.data();
  pa.num_tokens = c.tokens, pa.top_k = c.top_k, pa.hidden = hd, pa.num_experts = total;
  CHECK(permute(pa, cpu).ok());
  const IndexArray offset{&p.offset_value, IndexType::i64, 1},
      group_sizes{sizes.data(), IndexType::i32, total};
  MatmulArgs fc1;
  fc1.in_dtype = fc1.out_dtype = t, fc1.lhs = permuted.data(), fc1.rhs = p.w_in.data();
  fc1.bias = c.bias ? p.b_in.data() : nullptr, fc1.out = h.data(), fc1.m = slots, fc1.k = hd, fc1.n = fi;
  fc1.num_groups = c.experts, fc1.transpose_rhs = c.transpose, fc1.group_sizes = group_sizes;
  fc1.group_offset = offset;
  CHECK(grouped_matmul(fc1, cpu).ok());
  ActivationArgs aa;
  aa.dtype = t, aa.kind = c.activation, aa.h = h.data(), aa.out = act.data(), aa.rows = slots,
  aa.in_features = fi;
  CHECK(activation(aa, cpu).ok());
  MatmulArgs fc2 = fc1;
  fc2.lhs = act.data(), fc2.rhs = p.w_out.data(), fc2.bias = c.bias ? p.b_out.data() : nullptr,
  fc2.out = y.data();
  fc2.k = f, fc2.n = hd;
  CHECK(grouped_matmul(fc2, cpu).ok());
  UnpermuteArgs ua;
  ua.dtype = t, ua.probs_dtype = DType::f32, ua.permuted = y.data(), ua.row_map = row_map.data();
  ua.probs = c.probs ? p.probs.data() : nullptr, ua.out = out.data();
  ua.num_rows = slots, ua.num_tokens = c.tokens, ua.top_k = c.top_k, ua.hidden = hd;
  CHECK(unpermute(ua, cpu).ok());
  CHECK(same_bits(out, fused.out));
  for (int64_t s = 0; s < slots; ++s)  // h: the same pre-activations, in slot order
    if (p.local(s) < c.experts)
      CHECK(std::memcmp(&h[row_map[s] * fi], &fused.h[s * fi], fi * sizeof(T)) == 0);

  std::vector<T> dy(slots * hd), db_out(c.experts * hd);
  UnpermuteBackwardArgs ub;
  ub.dtype = t, ub.probs_dtype = DType::f32, ub.dout = p.dout.data(), ub.permuted = y.data();
  ub.row_map = row_map.data(), ub.probs = ua.probs, ub.dpermuted = dy.data();
  ub.num_rows = slots, ub.num_tokens = c.tokens, ub.top_k = c.top_k, ub.hidden = hd;
  CHECK(unpermute_backward(ub, cpu).ok());
  BiasGradArgs bg;
  bg.in_dtype = bg.out_dtype = t, bg.grad = dy.data(), bg.out = db_out.data(), bg.m = slots, bg.n = hd;
  bg.num_groups = c.experts, bg.group_sizes = group_sizes, bg.group_offset = offset;
  CHECK(grouped_bias_grad(bg, cpu).ok());
  CHECK(same_bits(db_out, fused.db_out));
}

template <typename T>
void check_thread_counts(const Case& c, int64_t block_rows) {
  g_case = std::string("threads ") + c.name + " " + dtype_name(dtype_of<T>());
  const Problem<T> p(c, 9);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const Fused<T> one = run_fused(p, block_rows);
  omp_set_num_threads(2);
  const Fused<T> two = run_fused(p, block_rows);
  omp_set_num_threads(threads);
  CHECK(same_bits(one.out, two.out) && same_bits(one.h, two.h) && same_bits(one.dtokens, two.dtokens));
  CHECK(same_bits(one.dprobs, two.dprobs) && same_bits(one.dw_in, two.dw_in) &&
        same_bits(one.dw_out, two.dw_out));
  CHECK(same_bits(one.db_in, two.db_in) && same_bits(one.db_out, two.db_out));
}

template <typename Fn>
void for_each_dtype(Fn fn) {
  fn(float{});
  fn(double{});
  fn(cpu::bf16_t{});
  fn(cpu::f16_t{});
}

// ---- the checks -----------------------------------------------------------------------------

bool invalid_naming(const Status& s, const char* text) {
  const bool ok = !s.ok() && s.message.find(text) != std::string::npos;
  if (!ok) std::printf("  status: %s\n", s.message.c_str());
  return ok;
}

void test_errors() {
  g_case = "expert_mlp_errors";
  float x[64] = {};
  const int64_t ids[4] = {0, 1, 0, 1};
  ExpertMlpArgs a;
  a.tokens = a.w_in = a.w_out = x, a.out = a.expert_rows = x;
  a.expert_indices = {ids, IndexType::i64, 4};
  a.num_tokens = 2, a.top_k = 2, a.hidden = 2, a.in_features = 4, a.num_experts = 2;
  CHECK(expert_mlp(a, ExecContext{}).ok());
  a.expert_indices.count = 3;
  CHECK(invalid_naming(expert_mlp(a, ExecContext{}), "expert_indices has 3 entries, expected T * k = 4"));
  a.expert_indices.count = 4, a.in_features = 3;
  CHECK(
      invalid_naming(expert_mlp(a, ExecContext{}), "fc1's output has 3 columns; swiglu needs an even count"));
  a.in_features = 4, a.hidden = -1;
  CHECK(invalid_naming(expert_mlp(a, ExecContext{}), "expert_mlp: H must be non-negative"));
  a.hidden = 2, a.expert_rows = nullptr;
  CHECK(invalid_naming(expert_mlp(a, ExecContext{}), "expert_rows is null"));
  a.expert_rows = x, a.probs = x, a.probs_dtype = DType::f16;
  CHECK(invalid_naming(expert_mlp(a, ExecContext{}), "probs must be float32, got float16"));
  a.probs = nullptr, a.group_offset = {ids, IndexType::i64, 2};
  CHECK(invalid_naming(expert_mlp(a, ExecContext{}), "group_offset must be a scalar"));
  a.group_offset = {}, a.num_tokens = int64_t(1) << 40;
  CHECK(invalid_naming(expert_mlp(a, ExecContext{}), "int32"));
  a.num_tokens = 2, a.dtype = DType::f64;
  ExecContext gpu;
  gpu.device = Device::cuda;
  CHECK(invalid_naming(expert_mlp(a, gpu), "float64"));
  a.dtype = DType::f32;
  CHECK(!expert_mlp(a, gpu).ok());  // no CUDA device (or no kernels): a status, never a crash

  ExpertMlpBackwardArgs b;
  b.dout = b.tokens = b.w_in = b.w_out = b.h = x;
  b.expert_indices = a.expert_indices;
  b.num_tokens = 2, b.top_k = 2, b.hidden = 2, b.in_features = 4, b.num_experts = 2;
  b.dtokens = x;
  CHECK(invalid_naming(expert_mlp_backward(b, ExecContext{}), "token_rows is null"));
  b.token_rows = x, b.h = nullptr;
  CHECK(invalid_naming(expert_mlp_backward(b, ExecContext{}), "h is null"));
  b.h = x, b.dprobs = x, b.probs_dtype = DType::bf16;
  CHECK(invalid_naming(expert_mlp_backward(b, ExecContext{}), "probs must be float32, got bfloat16"));
  b.probs_dtype = DType::f32;
  float grads[64];
  b.dtokens = b.dprobs = grads;
  CHECK(expert_mlp_backward(b, ExecContext{}).ok());
}

}  // namespace

int main() {
  test_window_bucket();
  test_routing_steps();
  test_cuda_workspace_layout();
  const Activation swiglu = Activation::swiglu, gelu = Activation::gelu, relu = Activation::relu,
                   silu = Activation::silu;
  const int64_t absent = -100;
  // name, T, k, H, F_in, E, activation, bias, transpose, probs, group_offset, max id
  const Case cases[] = {
      {"swiglu", 13, 2, 8, 12, 3, swiglu, false, false, true, absent, 3},
      {"gelu_bias_transposed", 11, 3, 6, 5, 4, gelu, true, true, true, absent, 4},
      {"relu_without_probs", 9, 2, 5, 7, 2, relu, true, false, false, absent, 2},
      {"silu_window", 14, 2, 7, 6, 2, silu, true, false, true, 2, 6},
      {"swiglu_window_transposed", 10, 4, 4, 8, 3, swiglu, true, true, true, 1, 5},
      {"negative_offset", 8, 2, 4, 6, 3, swiglu, false, false, true, -1, 3},
      {"idle_experts", 6, 1, 5, 4, 6, gelu, true, false, true, absent, 1},
      {"every_slot_dropped", 5, 2, 4, 6, 2, swiglu, true, false, true, 7, 3},
      {"many_blocks", 120, 2, 4, 4, 2, swiglu, true, true, true, absent, 1},
      {"no_tokens", 0, 2, 4, 6, 3, swiglu, true, false, true, absent, 3},
      {"k_zero", 4, 0, 4, 6, 3, swiglu, true, false, true, absent, 3},
      {"no_experts", 4, 2, 4, 6, 0, swiglu, true, false, true, absent, 3},
      {"h_zero", 4, 2, 0, 6, 2, swiglu, true, false, true, absent, 1},
      {"f_zero", 4, 2, 5, 0, 2, gelu, true, true, true, absent, 1},
  };
  for (const Case& c : cases)
    for (int64_t block_rows : {0, 7})  // the CPU's own blocks (one per expert here), short ones
      for_each_dtype([&](auto tag) { check_against_reference<decltype(tag)>(c, block_rows); });
  for (const Case& c : cases) {  // the dtypes CUDA runs
    check_cuda_sequence<float>(c);
    check_cuda_sequence<cpu::bf16_t>(c);
    check_cuda_sequence<cpu::f16_t>(c);
  }
  for (const Case& c : {cases[0], cases[1], cases[3], cases[4], cases[8]}) {
    check_composition_bits<float>(c);
    check_composition_bits<cpu::bf16_t>(c);
    check_composition_bits<cpu::f16_t>(c);
  }
  const Case skewed = {"skewed", 400, 2, 16, 24, 5, swiglu, true, false, true, absent, 1};
  // Every kept slot on expert 0: on two threads it runs alone, its blocks side by side where
  // its GEMMs run on one thread (every bfloat16 backward; every call on an AVX2 CPU).
  const Case one_hot_expert = {"one_hot_expert", 300, 2, 16, 24, 4, swiglu, true, true, true, absent, 0};
  for (const Case& c : {skewed, one_hot_expert})
    for_each_dtype([&](auto tag) { check_thread_counts<decltype(tag)>(c, 64); });
  test_errors();
  return report("expert_mlp_tests");
}
