// Core tests, built under AddressSanitizer + UndefinedBehaviorSanitizer: the schedule
// functions; the CPU backend through the public API; the CUDA backend's call sequence
// (src/call_sequence.h) run on a host launcher that executes its kernels' steps
// (host_launcher.h), including the late bias and the aligned/unaligned GEMM choice. Both
// backends run the edge cases of the semantics (clamped sizes, windows, empty groups,
// K/N/M = 0) in every accepted dtype pair against a naive double-precision reference;
// plus the CUDA workspace layout and its pointer and leading-dimension arithmetic.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "call_sequence.h"
#include "convert.h"
#include "gemm.h"
#include "groupgemm/groupgemm.h"
#include "host_launcher.h"
#include "lru_cache.h"

using namespace groupgemm;

namespace {

int passed = 0, failed = 0;

#define CHECK(cond)                                                                      \
  do {                                                                                   \
    if (cond) {                                                                          \
      ++passed;                                                                          \
    } else {                                                                             \
      ++failed;                                                                          \
      std::printf("FAILED %s:%d [%s]: %s\n", __FILE__, __LINE__, g_case.c_str(), #cond); \
    }                                                                                    \
  } while (0)

std::string g_case;

// ---- schedule --------------------------------------------------------------------

void test_schedule() {
  g_case = "schedule";
  const int64_t big = std::numeric_limits<int64_t>::max();
  CHECK(next_row_boundary(0, 5, 10) == 5);
  CHECK(next_row_boundary(8, 5, 10) == 10);    // clipped to M
  CHECK(next_row_boundary(3, -7, 10) == 3);    // negative counts as 0
  CHECK(next_row_boundary(9, big, 10) == 10);  // no overflow
  const int64_t m_big = int64_t(3) << 31;      // M*K beyond 2^31 is plain int64 math
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

// The dtype list (types.h): enum values, sizes and names.
void test_dtype_list() {
  g_case = "dtype_list";
  CHECK(kNumDTypes == 4);
  CHECK(int(DType::f32) == 0 && dtype_size(DType::f32) == 4 &&
        std::string(dtype_name(DType::f32)) == "float32");
  CHECK(int(DType::bf16) == 1 && dtype_size(DType::bf16) == 2 &&
        std::string(dtype_name(DType::bf16)) == "bfloat16");
  CHECK(int(DType::f16) == 2 && dtype_size(DType::f16) == 2 &&
        std::string(dtype_name(DType::f16)) == "float16");
  CHECK(int(DType::f64) == 3 && dtype_size(DType::f64) == 8 &&
        std::string(dtype_name(DType::f64)) == "float64");
}

// ---- both backends on the case table ----------------------------------------------

struct Case {
  const char* name;
  int64_t m, k, n;
  std::vector<int64_t> sizes;
  int64_t num_local;  // -1: sizes.size()
  int64_t offset;     // used when num_local >= 0
};

std::vector<std::pair<int64_t, int64_t>> ref_rows(const Case& c, int64_t g_local) {
  std::vector<std::pair<int64_t, int64_t>> rows;
  std::vector<int64_t> start(c.sizes.size() + 1, 0);
  for (size_t i = 0; i < c.sizes.size(); ++i)
    start[i + 1] = std::min(start[i] + std::max<int64_t>(c.sizes[i], 0), c.m);
  for (int64_t l = 0; l < g_local; ++l) {
    const int64_t g = (c.num_local >= 0 ? c.offset : 0) + l;
    if (g >= 0 && g < int64_t(c.sizes.size()))
      rows.push_back({start[g], start[g + 1]});
    else
      rows.push_back({0, 0});
  }
  return rows;
}

// Storage types of the four dtypes: double, float, cpu::bf16_t, cpu::f16_t.
template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, double>)
    return DType::f64;
  else if constexpr (std::is_same_v<T, float>)
    return DType::f32;
  else if constexpr (std::is_same_v<T, cpu::bf16_t>)
    return DType::bf16;
  else
    return DType::f16;
}

template <typename T>
T from_double(double v) {
  return emulated::store<T>(v);
}

template <typename T>
double to_double(T v) {
  return static_cast<double>(cpu::widen(v));
}

// Operand storage whose first element sits `shift` elements past a 64-byte boundary, so a
// test decides which operands the CUDA backend sees as 16-byte aligned.
template <typename T>
class Buffer {
 public:
  Buffer(const std::vector<T>& values, int64_t shift) : storage_(values.size() + 64 / sizeof(T) + shift) {
    while (reinterpret_cast<uintptr_t>(storage_.data() + offset_) % 64 != 0) ++offset_;
    offset_ += shift;
    std::copy(values.begin(), values.end(), data());
  }
  T* data() { return storage_.data() + offset_; }
  const T& operator[](int64_t i) const { return storage_[offset_ + i]; }
  std::vector<T> values(int64_t count) const {
    return {storage_.begin() + offset_, storage_.begin() + offset_ + count};
  }

 private:
  std::vector<T> storage_;
  int64_t offset_ = 0;
};

template <typename T>
std::vector<T> random_vec(int64_t count, std::mt19937& rng) {
  std::normal_distribution<double> d;
  std::vector<T> v(count);
  for (auto& x : v) x = from_double<T>(d(rng));
  return v;
}

template <typename T>
std::vector<T> nan_vec(int64_t count) {  // dirty output memory
  return std::vector<T>(count, from_double<T>(std::numeric_limits<double>::quiet_NaN()));
}

// Relative tolerance of an output of type T against the double reference of the same
// (already rounded) inputs: float32 accumulation, then one rounding to T.
template <typename T>
bool close(T a, double b) {
  const DType t = dtype_of<T>();
  const double tol = t == DType::f64   ? 1e-10
                     : t == DType::f32 ? 1e-4
                     : t == DType::f16 ? 1.0 / 1024
                                       : 1.0 / 128;
  return std::fabs(to_double(a) - b) <= tol * std::max(1.0, std::fabs(b));
}

// The CUDA backend's kernel choice, as the tests state it: float32 always runs its main
// kernel; 16-bit operands run the aligned (tensor-core) kernel only when K and N are
// multiples of 8 (16 bytes) and every operand the GEMM reads or writes starts on a
// 16-byte boundary.
bool expect_aligned_kernel(DType in, int64_t k, int64_t n, std::initializer_list<const void*> operands) {
  if (in == DType::f32) return true;
  bool aligned = k % 8 == 0 && n % 8 == 0;
  for (const void* p : operands)
    aligned = aligned && (p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0);
  return aligned;
}

// Which CUDA GEMM paths the emulated runs took, per input dtype and call kind.
struct PathsSeen {
  int aligned = 0, unaligned = 0;
};
PathsSeen g_forward_paths[kNumDTypes], g_wgrad_paths[kNumDTypes];
int g_late_bias_runs = 0;

// Runs the three entry points: the CPU backend through the public API, or the CUDA
// backend's call sequence on the host launcher, whose record the case then checks.
struct Runner {
  const char* name;
  std::function<Status(const MatmulArgs&)> matmul;
  std::function<Status(const WgradArgs&)> wgrad;
  std::function<Status(const BiasGradArgs&)> bias_grad;
  std::shared_ptr<emulated::LaunchRecord> record;  // the last call's; null for the CPU backend
  int64_t scan_chunks;
};

Runner cpu_backend() {
  return {"cpu",
          [](const MatmulArgs& a) { return grouped_matmul(a, ExecContext{}); },
          [](const WgradArgs& a) { return grouped_matmul_wgrad(a, ExecContext{}); },
          [](const BiasGradArgs& a) { return grouped_bias_grad(a, ExecContext{}); },
          nullptr,
          0};
}

// The setup kernel's scan with `scan_chunks` chunks: one, uneven ones, the kernel's block.
Runner emulated_cuda(int64_t scan_chunks) {
  auto record = std::make_shared<emulated::LaunchRecord>();
  auto run = [record, scan_chunks](const auto& args, int64_t num_groups, auto enqueue) {
    emulated::Workspace workspace(num_groups);
    emulated::HostLauncher launch(scan_chunks);
    const Status s = enqueue(args, workspace.data(), launch);
    *record = launch.record();
    return s;
  };
  return {"emulated_cuda",
          [run](const MatmulArgs& a) {
            return run(a, a.num_groups, enqueue_grouped_matmul<emulated::HostLauncher>);
          },
          [run](const WgradArgs& a) {
            return run(a, a.num_groups, enqueue_grouped_matmul_wgrad<emulated::HostLauncher>);
          },
          [run](const BiasGradArgs& a) {
            return run(a, a.num_groups, enqueue_grouped_bias_grad<emulated::HostLauncher>);
          },
          record,
          scan_chunks};
}

// Element offsets from a 64-byte boundary of each operand (all 0: every one aligned).
struct Shifts {
  int64_t lhs = 0, rhs = 0, bias = 0, grad = 0, out = 0;
};

// In: lhs, rhs, bias and grad; Out: the output of forward, wgrad (unless accumulating,
// which is float32, or float64 for float64 inputs) and dbias.
template <typename In, typename Out>
void run_case(const Case& c, const Runner& run, Shifts shift = {}) {
  using Wide = emulated::Accumulator<In>;
  const DType in = dtype_of<In>(), out_dtype = dtype_of<Out>();
  const std::string label = std::string(c.name) + " " + dtype_name(in) + "->" + dtype_name(out_dtype) + " " +
                            run.name + (run.record ? " scan chunks " + std::to_string(run.scan_chunks) : "");
  g_case = label;
  const int64_t G = c.num_local >= 0 ? c.num_local : int64_t(c.sizes.size());
  std::mt19937 rng(42);
  Buffer<In> lhs(random_vec<In>(c.m * c.k, rng), shift.lhs),
      rhs(random_vec<In>(G * c.k * c.n, rng), shift.rhs);
  Buffer<In> bias(random_vec<In>(G * c.n, rng), shift.bias), dout(random_vec<In>(c.m * c.n, rng), shift.grad);
  const auto rows = ref_rows(c, G);
  IndexArray sizes{c.sizes.data(), IndexType::i64, int64_t(c.sizes.size())};
  IndexArray offset = c.num_local >= 0 ? IndexArray{&c.offset, IndexType::i64, 1} : IndexArray{};
  const bool cuda_dtype = in != DType::f64;

  for (int transpose = 0; transpose < 2; ++transpose) {
    Buffer<Out> out(nan_vec<Out>(c.m * c.n), shift.out);
    MatmulArgs a;
    a.in_dtype = in, a.out_dtype = out_dtype;
    a.lhs = lhs.data(), a.rhs = rhs.data(), a.bias = bias.data(), a.out = out.data();
    a.m = c.m, a.k = c.k, a.n = c.n, a.num_groups = G, a.transpose_rhs = transpose;
    a.group_sizes = sizes, a.group_offset = offset;
    CHECK(run.matmul(a).ok());
    std::vector<bool> owned(c.m, false);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t r = rows[g].first; r < rows[g].second; ++r) {
        owned[r] = true;
        for (int64_t j = 0; j < c.n; ++j) {
          double want = to_double(bias[g * c.n + j]);
          for (int64_t i = 0; i < c.k; ++i)
            want += to_double(lhs[r * c.k + i]) *
                    to_double(rhs[g * c.k * c.n + (transpose ? j * c.k + i : i * c.n + j)]);
          CHECK(close(out[r * c.n + j], want));
        }
      }
    for (int64_t r = 0; r < c.m; ++r)
      if (!owned[r])
        for (int64_t j = 0; j < c.n; ++j) CHECK(to_double(out[r * c.n + j]) == 0.0);
    if (run.record) {
      const emulated::LaunchRecord& rec = *run.record;
      const bool gemm = c.m > 0 && c.n > 0 && c.k > 0 && G > 0;
      const bool late_bias = gemm && out_dtype != in;  // every case has a bias
      CHECK(rec.gemms == (gemm ? 1 : 0));
      CHECK(rec.late_bias == (late_bias ? 1 : 0));
      CHECK(rec.zero_k_problems == 0);  // no k = 0 problem reaches the GEMM
      if (gemm && cuda_dtype) {
        const bool want =
            expect_aligned_kernel(in, c.k, c.n, {a.lhs, a.rhs, a.out, late_bias ? nullptr : a.bias});
        CHECK(rec.gemm_aligned == want);
        PathsSeen& seen = g_forward_paths[int(in)];
        ++(rec.gemm_aligned ? seen.aligned : seen.unaligned);
        g_late_bias_runs += rec.late_bias;
      }
    }
  }

  for (int accumulate = 0; accumulate < 2; ++accumulate) {
    // Accumulating reads and writes a Wide buffer, otherwise the output is Out.
    Buffer<Wide> acc(random_vec<Wide>(G * c.k * c.n, rng), shift.out);
    Buffer<Out> fresh(nan_vec<Out>(G * c.k * c.n), shift.out);
    const std::vector<Wide> before = acc.values(G * c.k * c.n);
    WgradArgs a;
    a.in_dtype = in, a.out_dtype = accumulate ? dtype_of<Wide>() : out_dtype;
    a.lhs = lhs.data(), a.grad = dout.data();
    a.out = accumulate ? static_cast<void*>(acc.data()) : static_cast<void*>(fresh.data());
    a.m = c.m, a.k = c.k, a.n = c.n, a.num_groups = G, a.accumulate = accumulate;
    a.group_sizes = sizes, a.group_offset = offset;
    CHECK(run.wgrad(a).ok());
    for (int64_t g = 0; g < G; ++g) {
      const bool empty = rows[g].second == rows[g].first;
      for (int64_t i = 0; i < c.k; ++i)
        for (int64_t j = 0; j < c.n; ++j) {
          const int64_t e = (g * c.k + i) * c.n + j;
          if (empty && accumulate) {
            CHECK(std::memcmp(&acc[e], &before[e], sizeof(Wide)) == 0);  // bit-for-bit
          } else if (empty) {
            CHECK(to_double(fresh[e]) == 0.0);
          } else {
            double want = accumulate ? double(before[e]) : 0.0;
            for (int64_t r = rows[g].first; r < rows[g].second; ++r)
              want += to_double(lhs[r * c.k + i]) * to_double(dout[r * c.n + j]);
            CHECK(accumulate ? close(acc[e], want) : close(fresh[e], want));
          }
        }
    }
    if (run.record) {
      const emulated::LaunchRecord& rec = *run.record;
      const bool gemm = G > 0 && c.k > 0 && c.n > 0 && c.m > 0;
      CHECK(rec.gemms == (gemm ? 1 : 0));
      CHECK(rec.zero_k_problems == 0);
      if (gemm && cuda_dtype) {
        CHECK(rec.gemm_aligned == expect_aligned_kernel(in, c.k, c.n, {a.lhs, a.grad, a.out}));
        PathsSeen& seen = g_wgrad_paths[int(in)];
        ++(rec.gemm_aligned ? seen.aligned : seen.unaligned);
      }
    }
  }

  Buffer<Out> dbias(nan_vec<Out>(G * c.n), shift.out);
  BiasGradArgs b;
  b.in_dtype = in, b.out_dtype = out_dtype;
  b.grad = dout.data(), b.out = dbias.data(), b.m = c.m, b.n = c.n, b.num_groups = G;
  b.group_sizes = sizes, b.group_offset = offset;
  CHECK(run.bias_grad(b).ok());
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < c.n; ++j) {
      double want = 0;
      for (int64_t r = rows[g].first; r < rows[g].second; ++r) want += to_double(dout[r * c.n + j]);
      if (rows[g].second == rows[g].first)
        CHECK(to_double(dbias[g * c.n + j]) == 0.0);
      else
        CHECK(close(dbias[g * c.n + j], want));
    }
}

// Every dtype pair the core accepts (output in the input dtype, or float32 for 16-bit
// inputs) through one runner.
void run_all_dtypes(const Case& c, const Runner& run, Shifts shift = {}) {
  run_case<double, double>(c, run, shift);
  run_case<float, float>(c, run, shift);
  run_case<cpu::bf16_t, cpu::bf16_t>(c, run, shift);
  run_case<cpu::bf16_t, float>(c, run, shift);
  run_case<cpu::f16_t, cpu::f16_t>(c, run, shift);
  run_case<cpu::f16_t, float>(c, run, shift);
}

// bfloat16 weight gradients run the contraction in chunks of at most 2048 rows, the last
// padded with zero rows to a multiple of 64 (cpu/gemm_onednn.cpp): groups longer than a
// chunk, of one chunk exactly and of a few rows, into bfloat16, float32 and accumulated
// float32 output. Small integers keep every float32 sum exact, so the checks are too.
void test_bf16_wgrad_chunks() {
  g_case = "bf16_wgrad_chunks";
  const std::vector<int64_t> group_sizes = {2100, 0, 70, 2048, 5};
  const int64_t G = int64_t(group_sizes.size()), k = 8, n = 8;
  int64_t m = 0;
  for (int64_t s : group_sizes) m += s;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-2, 2);
  std::vector<cpu::bf16_t> lhs(m * k), grad(m * n);
  for (auto& v : lhs) v = cpu::narrow<cpu::bf16_t>(float(small(rng)));
  for (auto& v : grad) v = cpu::narrow<cpu::bf16_t>(float(small(rng)));
  std::vector<double> want(G * k * n, 0.0);
  for (int64_t g = 0, row = 0; g < G; row += group_sizes[g++])
    for (int64_t r = row; r < row + group_sizes[g]; ++r)
      for (int64_t i = 0; i < k; ++i)
        for (int64_t j = 0; j < n; ++j)
          want[(g * k + i) * n + j] += to_double(lhs[r * k + i]) * to_double(grad[r * n + j]);
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
  std::vector<cpu::bf16_t> bf16(G * k * n, cpu::bf16_t{0x7fc0});  // NaN
  a.accumulate = false, a.out_dtype = DType::bf16, a.out = bf16.data();
  CHECK(grouped_matmul_wgrad(a, ExecContext{}).ok());
  for (int64_t e = 0; e < G * k * n; ++e)  // one rounding of the exact sum (|sum| < 2^15)
    CHECK(std::fabs(to_double(bf16[e]) - want[e]) <= std::fabs(want[e]) / 256);
}

// The cache's policy on its own: least recently used evicted first, a value handed out
// stays valid after its eviction (AddressSanitizer would flag a use after free), a key
// asked for again after eviction is created anew, a failed creation caches nothing.
void test_lru_cache() {
  g_case = "lru_cache";
  int made = 0;
  auto make = [&made](int v) { return [&made, v] { return ++made, std::vector<int>(64, v); }; };
  cpu::LruCache<int, std::vector<int>> cache(2);
  const std::shared_ptr<const std::vector<int>> one = cache.get(1, make(1));
  cache.get(2, make(2));
  CHECK(cache.get(1, make(1)) == one && made == 2);  // a hit; 1 is now the most recent
  cache.get(3, make(3));                             // evicts 2
  CHECK(cache.size() == 2 && made == 3);
  CHECK(cache.get(1, make(1)) == one && made == 3);
  cache.get(2, make(2));  // created again; evicts 3
  cache.get(4, make(4));  // evicts 1 while `one` is still held
  CHECK(made == 5 && cache.size() == 2);
  CHECK((*one)[0] == 1 && (*one)[63] == 1);
  CHECK(cache.get(1, make(1)) != one && made == 6);
  bool threw = false;
  try {
    cache.get(5, []() -> std::vector<int> { throw std::runtime_error("no"); });
  } catch (const std::runtime_error&) {
    threw = true;
  }
  CHECK(threw && cache.size() == 2);
}

// bfloat16 forward with `k` columns into float32: small integers keep every result exact.
bool bf16_forward_exact(int64_t k) {
  const int64_t m = 4, n = 8;
  std::vector<cpu::bf16_t> lhs(m * k), rhs(k * n);
  for (int64_t i = 0; i < m * k; ++i) lhs[i] = cpu::narrow<cpu::bf16_t>(float(i % 3 - 1));
  for (int64_t i = 0; i < k * n; ++i) rhs[i] = cpu::narrow<cpu::bf16_t>(float(i % 5 - 2));
  std::vector<float> out(m * n, std::numeric_limits<float>::quiet_NaN());
  const int64_t sizes[] = {m};
  MatmulArgs a;
  a.in_dtype = DType::bf16, a.out_dtype = DType::f32;
  a.lhs = lhs.data(), a.rhs = rhs.data(), a.out = out.data();
  a.m = m, a.k = k, a.n = n, a.num_groups = 1, a.group_sizes = {sizes, IndexType::i64, 1};
  if (!grouped_matmul(a, ExecContext{}).ok()) return false;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) {
      double want = 0;
      for (int64_t i = 0; i < k; ++i) want += to_double(lhs[r * k + i]) * to_double(rhs[i * n + j]);
      if (out[r * n + j] != float(want)) return false;
    }
  return true;
}

// The CPU backend's oneDNN primitive cache stays bounded: more bfloat16 forward shapes
// than its capacity (one primitive per (K, N)), each result right, the first shape again
// after its eviction, and two threads adding shapes to the full cache at once.
void test_onednn_cache_bound() {
  g_case = "onednn_cache_bound";
  const int64_t shapes = int64_t(cpu::kOnednnCacheCapacity) + 44;
  for (int64_t s = 0; s < shapes; ++s) CHECK(bf16_forward_exact(1 + s));
  CHECK(cpu::onednn_cached_primitives() == cpu::kOnednnCacheCapacity);
  CHECK(bf16_forward_exact(1));  // evicted by now: created again
  bool results[2][48];
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t)
    threads.emplace_back([t, &results] {
      for (int s = 0; s < 48; ++s) results[t][s] = bf16_forward_exact(1000 + 2 * s + t);
    });
  for (std::thread& t : threads) t.join();
  for (const auto& thread_results : results)
    for (bool ok : thread_results) CHECK(ok);
  CHECK(cpu::onednn_cached_primitives() == cpu::kOnednnCacheCapacity);
}

void test_workspace() {
  g_case = "workspace";
  for (int64_t g : {0, 1, 3, 64, 1000}) {
    const WorkspaceLayout l = workspace_layout(g);
    const int64_t starts[] = {l.window, l.boundary, l.action, l.problem, l.ptr[0], l.ptr[1], l.ptr[2],
                              l.ptr[3], l.ld[0],    l.ld[1],  l.ld[2],   l.ld[3],  l.bytes};
    const int64_t sizes[] = {32,    (g + 1) * 8, g * 4, g * 12, g * 8, g * 8,
                             g * 8, g * 8,       g * 8, g * 8,  g * 8, g * 8};
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
  CHECK(ws.ld[1][0] == n);                                           // [K, N] weight
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

// Over all the runs: both GEMM kernels ran for each 16-bit dtype, forward and wgrad;
// float32 only ever ran its main one; the late bias ran.
void check_gemm_paths_seen() {
  g_case = "gemm_paths_seen";
  for (DType t : {DType::bf16, DType::f16}) {
    CHECK(g_forward_paths[int(t)].aligned > 0 && g_forward_paths[int(t)].unaligned > 0);
    CHECK(g_wgrad_paths[int(t)].aligned > 0 && g_wgrad_paths[int(t)].unaligned > 0);
  }
  const int f32 = int(DType::f32);
  CHECK(g_forward_paths[f32].aligned > 0 && g_forward_paths[f32].unaligned == 0);
  CHECK(g_wgrad_paths[f32].aligned > 0 && g_wgrad_paths[f32].unaligned == 0);
  CHECK(g_late_bias_runs > 0);
}

}  // namespace

int main() {
  test_schedule();
  test_dtype_list();
  const Case aligned_shape = {"k_n_multiples_of_8", 40, 16, 8,
                              {8, 0, 24, 8},        -1, 0};  // 16-bit: aligned kernel
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
      aligned_shape,
      {"k_not_multiple_of_8", 24, 12, 8, {6, 6, 6, 6}, -1, 0},
  };
  const Runner cpu = cpu_backend();
  const Runner cuda[] = {emulated_cuda(1), emulated_cuda(3), emulated_cuda(256)};
  for (const Case& c : cases) {
    run_all_dtypes(c, cpu);
    for (const Runner& run : cuda) run_all_dtypes(c, run);
  }
  // One operand an element past a 16-byte boundary (a view at an odd offset): a 16-bit
  // GEMM that reads or writes it runs the unaligned kernel; a late bias is not the GEMM's.
  for (int64_t Shifts::* operand : {&Shifts::lhs, &Shifts::rhs, &Shifts::bias, &Shifts::grad, &Shifts::out}) {
    Shifts shift;
    shift.*operand = 1;
    run_all_dtypes(aligned_shape, cpu, shift);
    run_all_dtypes(aligned_shape, cuda[1], shift);
  }
  check_gemm_paths_seen();
  test_bf16_wgrad_chunks();
  test_lru_cache();
  test_onednn_cache_bound();
  test_workspace();
  test_errors();
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
