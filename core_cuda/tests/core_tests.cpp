// Core tests, built under AddressSanitizer + UndefinedBehaviorSanitizer: the schedule
// functions, the CPU backend through the public API, and the CUDA backend's setup and
// fill steps emulated on the host, on the edge cases of the semantics (clamped sizes,
// windows, empty groups, K/N/M = 0), against a naive double-precision reference; plus
// the CUDA workspace layout and its pointer and leading-dimension arithmetic.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "groupgemm/groupgemm.h"
#include "setup.h"

using namespace groupgemm;

namespace {

int passed = 0, failed = 0;

#define CHECK(cond)                                                          \
  do {                                                                       \
    if (cond) {                                                              \
      ++passed;                                                              \
    } else {                                                                 \
      ++failed;                                                              \
      std::printf("FAILED %s:%d [%s]: %s\n", __FILE__, __LINE__, g_case, #cond); \
    }                                                                        \
  } while (0)

const char* g_case = "";

// ---- schedule --------------------------------------------------------------------

void test_schedule() {
  g_case = "schedule";
  const int64_t big = std::numeric_limits<int64_t>::max();
  CHECK(next_row_boundary(0, 5, 10) == 5);
  CHECK(next_row_boundary(8, 5, 10) == 10);       // clipped to M
  CHECK(next_row_boundary(3, -7, 10) == 3);       // negative counts as 0
  CHECK(next_row_boundary(9, big, 10) == 10);     // no overflow
  const int64_t m_big = int64_t(3) << 31;         // M*K beyond 2^31 is plain int64 math
  CHECK(next_row_boundary(m_big - 1, big, m_big) == m_big);

  GroupWindow w = group_window(0, 4, 4);
  CHECK(w.first == 0 && w.last == 4);
  w = group_window(4, 2, 6);  // window at the end
  CHECK(w.first == 4 && w.last == 6);
  w = group_window(5, 2, 6);  // runs past the end: clipped
  CHECK(w.first == 5 && w.last == 6);
  w = group_window(-1, 2, 6);  // starts before the first group
  CHECK(w.first == 0 && w.last == 1);
  w = group_window(9, 2, 6);  // entirely outside
  CHECK(w.first == w.last);
  w = group_window(big - 1, 4, 6);  // huge offset: no overflow
  CHECK(w.first == 6 && w.last == 6);
  w = group_window(0, 0, 0);
  CHECK(w.first == 0 && w.last == 0);
  CHECK(global_group(group_window(5, 2, 6), 5, 0) == 5);
  CHECK(global_group(group_window(5, 2, 6), 5, 1) == -1);

  const int32_t sizes[] = {3, 0, 4, -2, 5, 1};
  int64_t boundary[7];
  const GroupWindow all = group_window(0, 6, 6);
  window_row_boundaries(sizes, IndexType::i32, all, 10, boundary);
  const int64_t want[] = {0, 3, 3, 7, 7, 10, 10};  // 3+0+4+0+5 > 10: clipped
  CHECK(std::memcmp(boundary, want, sizeof want) == 0);
  CHECK(fold_row_boundary(sizes, IndexType::i32, 2, 5, 3, 10) == 10);  // one chunk of the scan
  CHECK(fold_row_boundary(sizes, IndexType::i32, 1, 4, 3, 10) == 7);
  w = group_window(2, 2, 6);
  int64_t window_boundary[3];
  window_row_boundaries(sizes, IndexType::i32, w, 10, window_boundary);
  CHECK(window_boundary[0] == 3 && window_boundary[1] == 7 && window_boundary[2] == 7);
  RowRange r = local_group_rows(window_boundary, w, 2, 0);
  CHECK(r.begin == 3 && r.end == 7);
  r = local_group_rows(window_boundary, w, 2, 1);
  CHECK(r.rows() == 0);
  r = owned_rows(window_boundary, w);
  CHECK(r.begin == 3 && r.end == 7);
  CHECK(group_of_row(boundary, all, 3) == 2);  // skips the empty group 1
  CHECK(group_of_row(boundary, all, 0) == 0);
  CHECK(group_of_row(boundary, all, 9) == 4);
  CHECK(group_of_row(boundary, all, 10) == -1);
  CHECK(group_of_row(window_boundary, w, 2) == -1);  // before the window: padding
  CHECK(group_of_row(window_boundary, w, 5) == 2);   // global index
  CHECK(group_of_row(window_boundary, w, 7) == -1);  // after the window
  const GroupWindow none = group_window(9, 2, 6);
  int64_t none_boundary[1];
  window_row_boundaries(sizes, IndexType::i32, none, 10, none_boundary);
  CHECK(owned_rows(none_boundary, none).rows() == 0 && group_of_row(none_boundary, none, 0) == -1);

  CHECK(ceil_div(0, 128) == 0 && ceil_div(129, 128) == 2);

  CHECK(reduction_action(3, false) == GroupAction::gemm);
  CHECK(reduction_action(0, false) == GroupAction::write_zero);
  CHECK(reduction_action(0, true) == GroupAction::leave_untouched);
  CHECK(forward_action(0, 8) == GroupAction::leave_untouched);
  CHECK(forward_action(4, 0) == GroupAction::write_zero);
  CHECK(forward_action(4, 8) == GroupAction::gemm);
}

// ---- CPU backend ------------------------------------------------------------------

struct Case {
  const char* name;
  int64_t m, k, n;
  std::vector<int64_t> sizes;
  int64_t num_local;   // -1: sizes.size()
  int64_t offset;      // used when num_local >= 0
};

std::vector<std::pair<int64_t, int64_t>> ref_rows(const Case& c, int64_t g_local) {
  std::vector<std::pair<int64_t, int64_t>> rows;
  std::vector<int64_t> start(c.sizes.size() + 1, 0);
  for (size_t i = 0; i < c.sizes.size(); ++i)
    start[i + 1] = std::min(start[i] + std::max<int64_t>(c.sizes[i], 0), c.m);
  for (int64_t l = 0; l < g_local; ++l) {
    const int64_t g = (c.num_local >= 0 ? c.offset : 0) + l;
    if (g >= 0 && g < int64_t(c.sizes.size())) rows.push_back({start[g], start[g + 1]});
    else rows.push_back({0, 0});
  }
  return rows;
}

template <typename T>
std::vector<T> random_vec(int64_t count, std::mt19937& rng) {
  std::normal_distribution<double> d;
  std::vector<T> v(count);
  for (auto& x : v) x = T(d(rng));
  return v;
}

template <typename T>
bool close(T a, double b) {
  const double tol = sizeof(T) == 8 ? 1e-10 : 1e-4;
  return std::fabs(double(a) - b) <= tol * std::max(1.0, std::fabs(b));
}

// Runs the three entry points: the CPU backend through the public API, or the CUDA
// backend's schedule emulated on the host (below).
struct Runner {
  Status (*matmul)(const MatmulArgs&);
  Status (*wgrad)(const WgradArgs&);
  Status (*bias_grad)(const BiasGradArgs&);
};

template <typename T>
void run_case(const Case& c, DType dt, const Runner& run) {
  g_case = c.name;
  const int64_t G = c.num_local >= 0 ? c.num_local : int64_t(c.sizes.size());
  std::mt19937 rng(42);
  auto lhs = random_vec<T>(c.m * c.k, rng), rhs = random_vec<T>(G * c.k * c.n, rng);
  auto bias = random_vec<T>(G * c.n, rng), dout = random_vec<T>(c.m * c.n, rng);
  const auto rows = ref_rows(c, G);
  IndexArray sizes{c.sizes.data(), IndexType::i64, int64_t(c.sizes.size())};
  IndexArray offset = c.num_local >= 0 ? IndexArray{&c.offset, IndexType::i64, 1} : IndexArray{};
  const T nan = std::numeric_limits<T>::quiet_NaN();

  for (int transpose = 0; transpose < 2; ++transpose) {
    std::vector<T> out(c.m * c.n, nan);  // dirty output memory
    MatmulArgs a;
    a.in_dtype = a.out_dtype = dt;
    a.lhs = lhs.data(), a.rhs = rhs.data(), a.bias = bias.data(), a.out = out.data();
    a.m = c.m, a.k = c.k, a.n = c.n, a.num_groups = G, a.transpose_rhs = transpose;
    a.group_sizes = sizes, a.group_offset = offset;
    CHECK(run.matmul(a).ok());
    std::vector<bool> owned(c.m, false);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = rows[g].first; r < rows[g].second; ++r) {
        owned[r] = true;
        for (int64_t j = 0; j < c.n; ++j) {
          double want = bias[g * c.n + j];
          for (int64_t i = 0; i < c.k; ++i)
            want += double(lhs[r * c.k + i]) *
                    double(rhs[g * c.k * c.n + (transpose ? j * c.k + i : i * c.n + j)]);
          CHECK(close(out[r * c.n + j], want));
        }
      }
    for (int64_t r = 0; r < c.m; ++r)
      if (!owned[r])
        for (int64_t j = 0; j < c.n; ++j) CHECK(out[r * c.n + j] == T(0));
  }

  for (int accumulate = 0; accumulate < 2; ++accumulate) {
    std::vector<T> out = accumulate ? random_vec<T>(G * c.k * c.n, rng) : std::vector<T>(G * c.k * c.n, nan);
    const std::vector<T> before = out;
    WgradArgs a;
    a.in_dtype = a.out_dtype = dt;
    a.lhs = lhs.data(), a.grad = dout.data(), a.out = out.data();
    a.m = c.m, a.k = c.k, a.n = c.n, a.num_groups = G, a.accumulate = accumulate;
    a.group_sizes = sizes, a.group_offset = offset;
    CHECK(run.wgrad(a).ok());
    for (int64_t g = 0; g < G; ++g) {
      const bool empty = rows[g].second == rows[g].first;
      for (int64_t i = 0; i < c.k; ++i)
        for (int64_t j = 0; j < c.n; ++j) {
          const int64_t e = (g * c.k + i) * c.n + j;
          if (empty && accumulate) {
            CHECK(std::memcmp(&out[e], &before[e], sizeof(T)) == 0);  // bit-for-bit
          } else if (empty) {
            CHECK(out[e] == T(0));
          } else {
            double want = accumulate ? double(before[e]) : 0.0;
            for (int64_t r = rows[g].first; r < rows[g].second; ++r)
              want += double(lhs[r * c.k + i]) * double(dout[r * c.n + j]);
            CHECK(close(out[e], want));
          }
        }
    }
  }

  std::vector<T> dbias(G * c.n, nan);
  BiasGradArgs b;
  b.in_dtype = b.out_dtype = dt;
  b.grad = dout.data(), b.out = dbias.data(), b.m = c.m, b.n = c.n, b.num_groups = G;
  b.group_sizes = sizes, b.group_offset = offset;
  CHECK(run.bias_grad(b).ok());
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < c.n; ++j) {
      double want = 0;
      for (int64_t r = rows[g].first; r < rows[g].second; ++r) want += dout[r * c.n + j];
      if (rows[g].second == rows[g].first) CHECK(dbias[g * c.n + j] == T(0));
      else CHECK(close(dbias[g * c.n + j], want));
    }
}

// bfloat16 weight gradients run the contraction in chunks of at most 2048 rows, the last
// padded with zero rows to a multiple of 64 (cpu/gemm_onednn.cpp): groups longer than a
// chunk, of one chunk exactly and of a few rows, into bfloat16, float32 and accumulated
// float32 output. Small integers keep every float32 sum exact, so the checks are too.
uint16_t bf16_bits(float v) {  // exact for the small integers used here
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return uint16_t(u >> 16);
}
float bf16_value(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

void test_bf16_wgrad_chunks() {
  g_case = "bf16_wgrad_chunks";
  const std::vector<int64_t> group_sizes = {2100, 0, 70, 2048, 5};
  const int64_t G = int64_t(group_sizes.size()), k = 8, n = 8;
  int64_t m = 0;
  for (int64_t s : group_sizes) m += s;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-2, 2);
  std::vector<uint16_t> lhs(m * k), grad(m * n);
  for (auto& v : lhs) v = bf16_bits(float(small(rng)));
  for (auto& v : grad) v = bf16_bits(float(small(rng)));
  std::vector<double> want(G * k * n, 0.0);
  for (int64_t g = 0, row = 0; g < G; row += group_sizes[g++])
    for (int64_t r = row; r < row + group_sizes[g]; ++r)
      for (int64_t i = 0; i < k; ++i)
        for (int64_t j = 0; j < n; ++j)
          want[(g * k + i) * n + j] += double(bf16_value(lhs[r * k + i])) * bf16_value(grad[r * n + j]);
  WgradArgs a;
  a.in_dtype = DType::bf16;
  a.lhs = lhs.data(), a.grad = grad.data();
  a.m = m, a.k = k, a.n = n, a.num_groups = G;
  a.group_sizes = {group_sizes.data(), IndexType::i64, G};
  std::vector<float> f32(G * k * n, std::numeric_limits<float>::quiet_NaN());
  a.out_dtype = DType::f32, a.out = f32.data();
  CHECK(grouped_matmul_wgrad(a, ExecContext{}).ok());
  for (int64_t e = 0; e < G * k * n; ++e) CHECK(f32[e] == float(want[e]));
  a.accumulate = true;  // adds the same sums again
  CHECK(grouped_matmul_wgrad(a, ExecContext{}).ok());
  for (int64_t e = 0; e < G * k * n; ++e) CHECK(f32[e] == float(2 * want[e]));
  std::vector<uint16_t> bf16(G * k * n, 0x7fc0);  // NaN
  a.accumulate = false, a.out_dtype = DType::bf16, a.out = bf16.data();
  CHECK(grouped_matmul_wgrad(a, ExecContext{}).ok());
  for (int64_t e = 0; e < G * k * n; ++e)  // one rounding of the exact sum (|sum| < 2^15)
    CHECK(std::fabs(bf16_value(bf16[e]) - want[e]) <= std::fabs(want[e]) / 256);
}

// ---- the CUDA backend's schedule, run on the host ----------------------------------
// The setup kernel's steps (src/setup.h) with `g_scan_chunks` chunks and a sequential
// exclusive scan, then the workspace executed the way the CUDA kernels read it: a
// grouped GEMM over (problem, pointers, lds) and the fill rules. Same order as
// cuda/backend.cu. Checked by run_case like the CPU backend.

int64_t g_scan_chunks = 1;

struct EmulatedWorkspace {
  explicit EmulatedWorkspace(int64_t num_groups)
      : storage((workspace_layout(num_groups).bytes + 7) / 8), view(workspace_view(storage.data(), num_groups)) {}
  std::vector<int64_t> storage;  // 8-byte aligned; every array is 16-byte aligned within it
  WorkspaceView view;
};

void emulate_setup(const SetupArgs& a) {
  const WorkspaceView ws = workspace_view(a.workspace, a.num_groups);
  const int64_t offset = read_group_offset(a.group_offset);
  const GroupWindow w = group_window(offset, a.num_groups, a.group_sizes.count);
  int64_t start = 0;  // exclusive scan over the chunks, in thread order
  for (int64_t t = 0; t < g_scan_chunks; ++t) {
    const RowRange chunk = setup_chunk(t, g_scan_chunks, w);
    write_chunk_boundaries(a, ws, w, chunk, start);
    start = next_row_boundary(start, chunk_rows(a, chunk), a.m);
  }
  write_window(ws, w, offset);
  if (a.kind == SetupKind::rows_only) return;
  for (int64_t local = 0; local < a.num_groups; ++local) write_group_setup(a, ws, local);
}

// D = A B + beta C for every problem, reading only the workspace.
template <typename T>
void emulate_grouped_gemm(const WorkspaceView& ws, int64_t num_groups, bool a_col, bool b_col, T beta) {
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t m = ws.problem[3 * g], n = ws.problem[3 * g + 1], k = ws.problem[3 * g + 2];
    const T* a = static_cast<const T*>(ws.ptr[0][g]);
    const T* b = static_cast<const T*>(ws.ptr[1][g]);
    const T* c = static_cast<const T*>(ws.ptr[2][g]);
    T* d = static_cast<T*>(ws.ptr[3][g]);
    const int64_t lda = ws.ld[0][g], ldb = ws.ld[1][g], ldc = ws.ld[2][g], ldd = ws.ld[3][g];
    CHECK(m == 0 || k > 0);  // no k = 0 problem reaches the GEMM
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        T acc = beta != T(0) ? beta * c[i * ldc + j] : T(0);
        for (int64_t p = 0; p < k; ++p)
          acc += (a_col ? a[p * lda + i] : a[i * lda + p]) * (b_col ? b[j * ldb + p] : b[p * ldb + j]);
        d[i * ldd + j] = acc;
      }
  }
}

template <typename T>
Status emulate_matmul(const MatmulArgs& a) {
  if (a.m == 0 || a.n == 0) return Status::Ok();
  EmulatedWorkspace ws(a.num_groups);
  const int64_t e = sizeof(T);
  emulate_setup({SetupKind::forward, a.group_sizes, a.group_offset, a.num_groups, a.m, a.k, a.n,
                 a.transpose_rhs, false, {a.lhs, a.rhs, a.bias, a.out, e, e, e, e}, ws.storage.data()});
  T* out = static_cast<T*>(a.out);
  const T* bias = static_cast<const T*>(a.bias);
  for (int64_t r = 0; r < a.m; ++r) {  // the fill kernel
    const RowFill fill = forward_row_fill(ws.view, r, a.k == 0, bias != nullptr);
    if (!fill.write) continue;
    for (int64_t j = 0; j < a.n; ++j) out[r * a.n + j] = fill.local >= 0 ? bias[fill.local * a.n + j] : T(0);
  }
  if (a.k == 0 || a.num_groups == 0) return Status::Ok();
  emulate_grouped_gemm<T>(ws.view, a.num_groups, false, a.transpose_rhs, a.bias ? T(1) : T(0));
  return Status::Ok();
}

template <typename T>
Status emulate_wgrad(const WgradArgs& a) {
  if (a.num_groups == 0 || a.k == 0 || a.n == 0) return Status::Ok();
  EmulatedWorkspace ws(a.num_groups);
  const int64_t e = sizeof(T);
  emulate_setup({SetupKind::wgrad, a.group_sizes, a.group_offset, a.num_groups, a.m, a.k, a.n, false,
                 a.accumulate, {a.lhs, a.grad, a.accumulate ? a.out : nullptr, a.out, e, e, e, e},
                 ws.storage.data()});
  for (int64_t g = 0; g < a.num_groups; ++g)  // the empty-group kernel
    if (!a.accumulate && ws.view.action[g] == int32_t(GroupAction::write_zero))
      std::fill_n(static_cast<T*>(a.out) + g * a.k * a.n, a.k * a.n, T(0));
  if (a.m == 0) return Status::Ok();
  emulate_grouped_gemm<T>(ws.view, a.num_groups, true, false, a.accumulate ? T(1) : T(0));
  return Status::Ok();
}

template <typename T>
Status emulate_bias_grad(const BiasGradArgs& a) {
  if (a.num_groups == 0 || a.n == 0) return Status::Ok();
  EmulatedWorkspace ws(a.num_groups);
  emulate_setup({SetupKind::rows_only, a.group_sizes, a.group_offset, a.num_groups, a.m, 0, a.n, false,
                 false, {}, ws.storage.data()});
  const T* grad = static_cast<const T*>(a.grad);
  for (int64_t g = 0; g < a.num_groups; ++g) {
    const RowRange rows = workspace_group_rows(ws.view, g);
    for (int64_t j = 0; j < a.n; ++j) {
      T sum = 0;
      for (int64_t r = rows.begin; r < rows.end; ++r) sum += grad[r * a.n + j];
      static_cast<T*>(a.out)[g * a.n + j] = sum;
    }
  }
  return Status::Ok();
}

template <typename T>
Runner emulated_cuda() {
  return {emulate_matmul<T>, emulate_wgrad<T>, emulate_bias_grad<T>};
}

Runner cpu_backend() {
  return {[](const MatmulArgs& a) { return grouped_matmul(a, ExecContext{}); },
          [](const WgradArgs& a) { return grouped_matmul_wgrad(a, ExecContext{}); },
          [](const BiasGradArgs& a) { return grouped_bias_grad(a, ExecContext{}); }};
}

void test_workspace() {
  g_case = "workspace";
  for (int64_t g : {0, 1, 3, 64, 1000}) {
    const WorkspaceLayout l = workspace_layout(g);
    const int64_t starts[] = {l.window, l.boundary, l.action, l.problem, l.ptr[0], l.ptr[1], l.ptr[2],
                              l.ptr[3], l.ld[0], l.ld[1], l.ld[2], l.ld[3], l.bytes};
    const int64_t sizes[] = {32, (g + 1) * 8, g * 4, g * 12, g * 8, g * 8, g * 8, g * 8, g * 8, g * 8, g * 8, g * 8};
    for (int i = 0; i < 12; ++i) {
      CHECK(starts[i] % 16 == 0);
      CHECK(starts[i] + sizes[i] <= starts[i + 1]);  // in order, no overlap
    }
    CHECK(grouped_matmul_workspace_bytes(Device::cuda, g) == l.bytes);
    CHECK(grouped_matmul_workspace_bytes(Device::cpu, g) == 0);
  }

  // Pointer and leading-dimension arithmetic of one group, in int64 past 2^31 elements.
  std::vector<int64_t> storage(workspace_layout(2).bytes / 8);
  const WorkspaceView ws = workspace_view(storage.data(), 2);
  const int64_t begin = int64_t(3) << 31, k = 1024, n = 96;
  alignas(16) static const char base[16] = {};
  const GemmOperands ops{base, base + 1, base + 2, const_cast<char*>(base + 3), 2, 2, 2, 4};
  write_group(ws, 1, forward_problem({begin, begin + 5}, 1, k, n, true), ops);
  CHECK(ws.action[1] == int32_t(GroupAction::gemm));
  CHECK(ws.problem[3] == 5 && ws.problem[4] == n && ws.problem[5] == k);
  CHECK(static_cast<const char*>(ws.ptr[0][1]) == base + begin * k * 2);
  CHECK(static_cast<const char*>(ws.ptr[1][1]) == base + 1 + k * n * 2);
  CHECK(static_cast<const char*>(ws.ptr[2][1]) == base + 2 + n * 2);  // bias row of group 1
  CHECK(static_cast<const char*>(ws.ptr[3][1]) == base + 3 + begin * n * 4);
  CHECK(ws.ld[0][1] == k && ws.ld[1][1] == k && ws.ld[2][1] == 0 && ws.ld[3][1] == n);
  write_group(ws, 0, forward_problem({0, 5}, 0, k, n, false), ops);
  CHECK(ws.ld[1][0] == n);  // [K, N] weight
  write_group(ws, 0, forward_problem({7, 7}, 0, k, n, false), ops);  // empty: no GEMM problem
  CHECK(ws.action[0] == int32_t(GroupAction::leave_untouched));
  CHECK(ws.problem[0] == 0 && ws.problem[1] == 0 && ws.problem[2] == 0);
  write_group(ws, 0, forward_problem({0, 5}, 0, 0, n, false), ops);  // K = 0: fill, no GEMM
  CHECK(ws.action[0] == int32_t(GroupAction::write_zero) && ws.problem[0] == 0);

  const GemmOperands wgrad_ops{base, base + 1, nullptr, const_cast<char*>(base + 3), 2, 2, 4, 4};
  write_group(ws, 1, wgrad_problem({begin, begin + 5}, 1, k, n, false), wgrad_ops);
  CHECK(ws.problem[3] == k && ws.problem[4] == n && ws.problem[5] == 5);  // contracts over rows
  CHECK(static_cast<const char*>(ws.ptr[0][1]) == base + begin * k * 2 && ws.ld[0][1] == k);
  CHECK(static_cast<const char*>(ws.ptr[1][1]) == base + 1 + begin * n * 2 && ws.ld[1][1] == n);
  CHECK(ws.ptr[2][1] == ws.ptr[3][1]);  // no C: points at D, never read with beta = 0
  CHECK(static_cast<const char*>(ws.ptr[3][1]) == base + 3 + k * n * 4);
  write_group(ws, 1, wgrad_problem({4, 4}, 1, k, n, true), wgrad_ops);  // empty, accumulating
  CHECK(ws.action[1] == int32_t(GroupAction::leave_untouched) && ws.problem[5] == 0);
  write_group(ws, 1, wgrad_problem({4, 4}, 1, k, n, false), wgrad_ops);
  CHECK(ws.action[1] == int32_t(GroupAction::write_zero) && ws.problem[3] == 0);
}

void test_errors() {
  g_case = "errors";
  float x = 0;
  int64_t sizes[2] = {1, 1};
  MatmulArgs a;
  a.lhs = a.rhs = &x, a.out = &x;
  a.m = 2, a.k = 1, a.n = 1, a.num_groups = 3;
  a.group_sizes = {sizes, IndexType::i64, 2};
  Status s = grouped_matmul(a, ExecContext{});
  CHECK(!s.ok() && s.message.find("group_sizes has 2 entries") != std::string::npos);
  a.num_groups = 2, a.m = -1;
  CHECK(grouped_matmul(a, ExecContext{}).code == Status::Code::invalid_argument);
  a.m = 2, a.lhs = nullptr;
  s = grouped_matmul(a, ExecContext{});
  CHECK(!s.ok() && s.message.find("lhs is null") != std::string::npos);
  a.lhs = &x, a.out_dtype = DType::bf16;
  CHECK(grouped_matmul(a, ExecContext{}).code == Status::Code::invalid_argument);
  WgradArgs w;
  w.in_dtype = DType::bf16, w.out_dtype = DType::bf16, w.accumulate = true;
  w.group_sizes = {sizes, IndexType::i64, 2}, w.num_groups = 2;
  s = grouped_matmul_wgrad(w, ExecContext{});
  CHECK(!s.ok() && s.message.find("accumulate_into must be float32") != std::string::npos);
  a.out_dtype = DType::f32;
  ExecContext gpu;
  gpu.device = Device::cuda;
  s = grouped_matmul(a, gpu);  // no device memory is touched: a clear status either way
  CHECK(!s.ok() && s.message.find("CUDA") != std::string::npos);
}

}  // namespace

int main() {
  test_schedule();
  const std::vector<Case> cases = {
      {"uniform", 24, 8, 6, {6, 6, 6, 6}, -1, 0},
      {"first_empty", 24, 8, 6, {0, 8, 8, 8}, -1, 0},
      {"middle_empty", 24, 8, 6, {8, 0, 8, 8}, -1, 0},
      {"last_empty", 24, 8, 6, {8, 8, 8, 0}, -1, 0},
      {"all_empty", 16, 8, 6, {0, 0, 0, 0}, -1, 0},
      {"m_zero", 0, 8, 6, {0, 0}, -1, 0},
      {"g_zero", 5, 8, 6, {}, -1, 0},
      {"k_zero", 9, 0, 6, {4, 0, 5}, -1, 0},
      {"n_zero", 9, 8, 0, {4, 0, 5}, -1, 0},
      {"sum_below_m", 30, 8, 6, {5, 5, 5}, -1, 0},
      {"sum_above_m", 10, 8, 6, {4, 4, 4, 4}, -1, 0},
      {"negative", 12, 8, 6, {5, -3, 4, 2}, -1, 0},
      {"offset_start", 15, 8, 6, {3, 0, 4, 2, 5, 1}, 2, 0},
      {"offset_end", 15, 8, 6, {3, 0, 4, 2, 5, 1}, 2, 4},
      {"offset_past_end", 15, 8, 6, {3, 0, 4, 2, 5, 1}, 2, 5},
      {"offset_before_start", 15, 8, 6, {3, 0, 4, 2, 5, 1}, 2, -1},
  };
  for (const Case& c : cases) {
    run_case<double>(c, DType::f64, cpu_backend());
    run_case<float>(c, DType::f32, cpu_backend());
    for (int64_t chunks : {1, 3, 256}) {  // one chunk, uneven chunks, the kernel's block
      g_scan_chunks = chunks;
      run_case<double>(c, DType::f64, emulated_cuda<double>());
      run_case<float>(c, DType::f32, emulated_cuda<float>());
    }
  }
  test_bf16_wgrad_chunks();
  test_workspace();
  test_errors();
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
