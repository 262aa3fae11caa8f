// Core tests, built under AddressSanitizer + UndefinedBehaviorSanitizer: the schedule
// functions; the CPU backend through the public API; the CUDA backend's call sequence
// (src/call_sequence.h) run on a host launcher that executes its kernels' steps
// (host_launcher.h), including where a bias enters and the aligned/unaligned GEMM choice. Both
// backends run the edge cases of the semantics (clamped sizes, windows, empty groups,
// K/N/M = 0) in every accepted dtype pair against a naive double-precision reference;
// plus the CUDA workspace layout and its pointer and leading-dimension arithmetic.
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "backends.h"
#include "call_sequence.h"
#include "check.h"
#include "convert.h"
#include "gathered_kernel_choice.h"
#include "gathered_tiles.h"
#include "gemm.h"
#include "groupgemm/activation.h"
#include "groupgemm/groupgemm.h"
#include "groupgemm/permute.h"
#include "groupgemm/router.h"
#include "host_launcher.h"
#include "kernel_choice.h"
#include "lru_cache.h"
#include "permute_workspace.h"
#include "sm90_strides.h"
#include "thread_plan.h"

using namespace groupgemm;
using namespace groupgemm_tests;

namespace {

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
  const IndexArray size_array{sizes, IndexType::i32, 6};
  window_row_boundaries(size_array, all, 10, boundary);
  const int64_t want[] = {0, 3, 3, 7, 7, 10, 10};  // 3+0+4+0+5 > 10: clipped
  CHECK(std::memcmp(boundary, want, sizeof want) == 0);
  CHECK(fold_row_boundary(size_array, 2, 5, 3, 10) == 10);  // one chunk of the scan
  CHECK(fold_row_boundary(size_array, 1, 4, 3, 10) == 7);
  // The same groups as cumulative ends (torch's offs): a decrease is an empty group.
  const int64_t ends[] = {3, 3, 7, 5, 10, 11};
  IndexArray end_array{ends, IndexType::i64, 6};
  end_array.cumulative = true;
  int64_t end_boundary[7];
  window_row_boundaries(end_array, all, 10, end_boundary);
  CHECK(std::memcmp(end_boundary, want, sizeof want) == 0);
  for (int64_t g = 0; g < 6; ++g) CHECK(load_group_size(end_array, g) == std::max<int64_t>(sizes[g], 0));
  const int64_t extreme[] = {std::numeric_limits<int64_t>::min(), big, -1};
  IndexArray extreme_ends{extreme, IndexType::i64, 3};
  extreme_ends.cumulative = true;
  CHECK(load_group_size(extreme_ends, 0) == 0);    // a negative first end: empty
  CHECK(load_group_size(extreme_ends, 1) == big);  // 2^64 - 1 apart: saturates, no overflow
  CHECK(load_group_size(extreme_ends, 2) == 0);
  w = group_window(2, 2, 6);
  int64_t window_boundary[3];
  window_row_boundaries(size_array, w, 10, window_boundary);
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
  window_row_boundaries(size_array, none, 10, none_boundary);
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
int g_prefilled_bias_runs = 0;

// Runs the four entry points: the CPU backend through the public API, or the CUDA
// backend's call sequence on the host launcher, whose record the case then checks.
struct Runner {
  const char* name;
  std::function<Status(const MatmulArgs&)> matmul;
  std::function<Status(const WgradArgs&)> wgrad;
  std::function<Status(const BiasGradArgs&)> bias_grad;
  std::function<Status(const BackwardArgs&)> backward;
  std::shared_ptr<emulated::LaunchRecord> record;  // the last call's; null for the CPU backend
  int64_t scan_chunks;
};

Runner cpu_backend() {
  return {"cpu",
          [](const MatmulArgs& a) { return grouped_matmul(a, ExecContext{}); },
          [](const WgradArgs& a) { return grouped_matmul_wgrad(a, ExecContext{}); },
          [](const BiasGradArgs& a) { return grouped_bias_grad(a, ExecContext{}); },
          [](const BackwardArgs& a) { return grouped_matmul_backward(a, ExecContext{}); },
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
          [run](const BackwardArgs& a) {
            return run(a, a.num_groups, enqueue_grouped_matmul_backward<emulated::HostLauncher>);
          },
          record,
          scan_chunks};
}

// Element offsets from a 64-byte boundary of each operand (all 0: every one aligned).
struct Shifts {
  int64_t lhs = 0, rhs = 0, bias = 0, grad = 0, out = 0;
};

template <typename T>
bool same_bits(const T* a, const T* b, int64_t count) {
  return count == 0 || std::memcmp(a, b, count * sizeof(T)) == 0;
}

// The backward entry point: with every subset of its outputs, each gradient has the bits
// of its separate call (the dgrad grouped_matmul, the wgrad, the bias gradient); on the
// host launcher, one setup and one launch per requested GEMM and bias gradient.
template <typename In, typename Out, typename B>
void check_backward_case(const Case& c, const Runner& run, B& lhs, B& rhs, B& dout,
                         IndexArray sizes, IndexArray offset, int64_t G, const std::string& label) {
  using Wide = emulated::Accumulator<In>;
  std::mt19937 rng(43);
  const std::vector<Wide> acc_init = random_vec<Wide>(G * c.k * c.n, rng);
  for (int transpose = 0; transpose < 2; ++transpose)
    for (int accumulate = 0; accumulate < 2; ++accumulate)
      for (int wanted = 1; wanted < 8; ++wanted) {  // bit 0: dlhs, 1: drhs, 2: dbias
        g_case = label + " backward T=" + std::to_string(transpose) + " acc=" + std::to_string(accumulate) +
                 " wanted=" + std::to_string(wanted);
        const bool want_dlhs = wanted & 1, want_drhs = wanted & 2, want_dbias = wanted & 4;
        const DType drhs_dtype = accumulate ? dtype_of<Wide>() : dtype_of<Out>();
        std::vector<In> dlhs = nan_vec<In>(c.m * c.k), dlhs_sep = dlhs;
        std::vector<Wide> drhs_acc = acc_init, drhs_acc_sep = acc_init;
        std::vector<Out> drhs_out = nan_vec<Out>(G * c.k * c.n), drhs_out_sep = drhs_out;
        std::vector<Out> dbias = nan_vec<Out>(G * c.n), dbias_sep = dbias;
        void* drhs = accumulate ? static_cast<void*>(drhs_acc.data()) : static_cast<void*>(drhs_out.data());
        void* drhs_sep =
            accumulate ? static_cast<void*>(drhs_acc_sep.data()) : static_cast<void*>(drhs_out_sep.data());
        BackwardArgs b;
        b.in_dtype = dtype_of<In>();
        b.lhs = lhs.data(), b.rhs = rhs.data(), b.grad = dout.data();
        b.dlhs = want_dlhs ? dlhs.data() : nullptr;
        b.drhs = want_drhs ? drhs : nullptr, b.drhs_dtype = drhs_dtype, b.accumulate = accumulate;
        b.dbias = want_dbias ? dbias.data() : nullptr, b.dbias_dtype = dtype_of<Out>();
        b.m = c.m, b.k = c.k, b.n = c.n, b.num_groups = G, b.transpose_rhs = transpose;
        b.group_sizes = sizes, b.group_offset = offset;
        CHECK(run.backward(b).ok());
        if (run.record) {
          const emulated::LaunchRecord& rec = *run.record;
          const int gemms = (want_dlhs && c.m > 0 && c.k > 0 && c.n > 0 && G > 0) +
                            (want_drhs && G > 0 && c.k > 0 && c.n > 0 && c.m > 0);
          const bool dbias_runs = want_dbias && G > 0 && c.n > 0;
          const bool any = (want_dlhs && c.m > 0 && c.k > 0) || (want_drhs && G > 0 && c.k > 0 && c.n > 0) ||
                           dbias_runs;
          CHECK(rec.gemms == gemms && rec.launches == (any ? 1 + gemms + dbias_runs : 0));
        }
        BackwardArgs sep = b;
        sep.dlhs = dlhs_sep.data(), sep.drhs = drhs_sep, sep.dbias = dbias_sep.data();
        if (want_dlhs) CHECK(run.matmul(dgrad_part(sep)).ok());
        if (want_drhs) CHECK(run.wgrad(wgrad_part(sep)).ok());
        if (want_dbias) CHECK(run.bias_grad(bias_grad_part(sep)).ok());
        if (want_dlhs) CHECK(same_bits(dlhs.data(), dlhs_sep.data(), c.m * c.k));
        if (want_drhs)
          CHECK(accumulate ? same_bits(drhs_acc.data(), drhs_acc_sep.data(), G * c.k * c.n)
                           : same_bits(drhs_out.data(), drhs_out_sep.data(), G * c.k * c.n));
        if (want_dbias) CHECK(same_bits(dbias.data(), dbias_sep.data(), G * c.n));
      }
}

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
      // Every case has a bias: in the epilogue, or (a float32 output of 16-bit inputs)
      // written into the output rows by the setup and added onto by the GEMM.
      const bool prefilled_bias = out_dtype != in;
      CHECK(rec.launches == (c.m > 0 && c.n > 0 ? (gemm ? 2 : 1) : 0));  // setup, GEMM
      CHECK(rec.gemms == (gemm ? 1 : 0));
      CHECK(rec.zero_k_problems == 0);  // no k = 0 problem reaches the GEMM
      if (gemm) CHECK(rec.gemm_c == (prefilled_bias ? GemmC::output : GemmC::bias_row));
      if (gemm && cuda_dtype) {
        const bool want =
            expect_aligned_kernel(in, c.k, c.n, {a.lhs, a.rhs, a.out, prefilled_bias ? nullptr : a.bias});
        CHECK(rec.gemm_aligned == want);
        PathsSeen& seen = g_forward_paths[int(in)];
        ++(rec.gemm_aligned ? seen.aligned : seen.unaligned);
        g_prefilled_bias_runs += prefilled_bias;
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
      CHECK(rec.launches == (G > 0 && c.k > 0 && c.n > 0 ? (gemm ? 2 : 1) : 0));
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
  if (run.record) CHECK(run.record->launches == (G > 0 && c.n > 0 ? 2 : 0));
  check_backward_case<In, Out>(c, run, lhs, rhs, dout, sizes, offset, G, label);
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

// bfloat16 weight gradients, in both of the CPU backend's ways (cpu/gemm_onednn.cpp): on
// AMX CPUs the contraction runs in chunks of at most 2048 rows, the last padded with zero
// rows to a multiple of 64, elsewhere as one all-run-time GEMM. Groups longer than a
// chunk, of one chunk exactly and of a few rows, into bfloat16, float32 and accumulated
// float32 output. Small integers keep every float32 sum exact, so the checks are too.
void check_bf16_wgrad() {
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

void test_bf16_wgrad_chunks() {
  for (bool chunks : {true, false}) {
    g_case = chunks ? "bf16_wgrad_in_chunks" : "bf16_wgrad_run_time";
    cpu::force_bf16_wgrad_chunks(chunks);
    check_bf16_wgrad();
  }
  cpu::force_bf16_wgrad_chunks(std::nullopt);
}

// oneDNN's all-run-time bfloat16 kernel splits a long contraction over a small output
// across threads (measured: other bits on 2 threads than on 1), so the backend keeps such
// a weight gradient on one thread: the bits must not depend on the thread count.
void test_bf16_wgrad_bits_on_any_thread_count() {
  g_case = "bf16_wgrad_thread_count";
  cpu::force_bf16_wgrad_chunks(false);
  const std::vector<int64_t> group_sizes = {30000, 200, 5};
  const int64_t G = 3, k = 64, n = 32, m = 30205;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<cpu::bf16_t> lhs(m * k), grad(m * n);
  for (auto& v : lhs) v = cpu::narrow<cpu::bf16_t>(normal(rng));
  for (auto& v : grad) v = cpu::narrow<cpu::bf16_t>(normal(rng));
  WgradArgs a;
  a.in_dtype = DType::bf16, a.out_dtype = DType::f32;
  a.lhs = lhs.data(), a.grad = grad.data();
  a.m = m, a.k = k, a.n = n, a.num_groups = G;
  a.group_sizes = {group_sizes.data(), IndexType::i64, G};
  std::vector<float> one(G * k * n), two(G * k * n);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  a.out = one.data();
  CHECK(grouped_matmul_wgrad(a, ExecContext{}).ok());
  omp_set_num_threads(2);
  a.out = two.data();
  CHECK(grouped_matmul_wgrad(a, ExecContext{}).ok());
  omp_set_num_threads(threads);
  CHECK(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)) == 0);
  cpu::force_bf16_wgrad_chunks(std::nullopt);
}

// On a CPU that widens bfloat16 (AVX2; Intel's AVX-512 without AMX) a bfloat16 call runs as
// float32 on its operands widened: its output is the float32 call's on the same values,
// rounded once to a bfloat16 output, bit for bit, in every layout, with a bias, and
// accumulating. The weight gradients' exact sums hold too.
void test_bf16_widened() {
  g_case = "bf16_widened";
  cpu::force_bf16_widened(true);
  const int64_t m = 37, k = 70, n = 24;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  auto values = [&](int64_t count) {
    std::vector<cpu::bf16_t> v(count);
    for (auto& x : v) x = cpu::narrow<cpu::bf16_t>(normal(rng));
    return v;
  };
  auto widened = [](const std::vector<cpu::bf16_t>& v) {
    std::vector<float> w(v.size());
    for (size_t i = 0; i < v.size(); ++i) w[i] = cpu::widen(v[i]);
    return w;
  };
  const std::vector<cpu::bf16_t> a = values(m * k), b = values(k * n), bias = values(n), before = values(m * n);
  const std::vector<float> a32 = widened(a), b32 = widened(b), bias32 = widened(bias), before32 = widened(before);
  for (const bool a_t : {false, true})
    for (const bool b_t : {false, true})
      for (const bool accumulate : {false, true})
        for (const DType out : {DType::bf16, DType::f32}) {
          std::vector<float> want = before32;
          CHECK(cpu::gemm({DType::f32, DType::f32, m, n, k, a32.data(), a_t, b32.data(), b_t, bias32.data(),
                           want.data(), accumulate})
                    .ok());
          std::vector<cpu::bf16_t> got16 = before;
          std::vector<float> got32 = before32;
          void* got = out == DType::bf16 ? static_cast<void*>(got16.data()) : got32.data();
          CHECK(cpu::gemm({DType::bf16, out, m, n, k, a.data(), a_t, b.data(), b_t, bias.data(), got, accumulate})
                    .ok());
          for (int64_t i = 0; i < m * n; ++i)
            CHECK(out == DType::bf16 ? cpu::narrow<cpu::bf16_t>(want[i]).bits == got16[i].bits
                                     : std::memcmp(&want[i], &got32[i], sizeof(float)) == 0);
        }
  check_bf16_wgrad();
  cpu::force_bf16_widened(std::nullopt);
}

// Which GEMMs run alone (thread_plan.h): uniform and many small groups share the threads;
// a group with a thread's share of the work, or skew that would idle a thread, runs alone.
void test_thread_plan() {
  g_case = "thread_plan";
  using cpu::gemms_run_alone;
  CHECK(gemms_run_alone({8, 8, 8, 8, 8, 8, 8, 8}, 2) == 0);
  CHECK(gemms_run_alone({8, 8, 8, 8, 8, 8, 8, 8}, 1) == 0);
  CHECK(gemms_run_alone({}, 2) == 0);
  CHECK(gemms_run_alone({100}, 2) == 1);    // one GEMM: all threads on it
  CHECK(gemms_run_alone({10, 1}, 2) == 1);  // side by side, one thread would idle 90%
  CHECK(gemms_run_alone({5, 5}, 2) == 0);   // two halves: no thread idles
  CHECK(gemms_run_alone({5, 4, 1}, 2) == 0);
  // Measured routing (rows of 8 experts, a quarter empty, the rest Dirichlet-skewed): side
  // by side, one thread would take 1711 + 578 of 4096 rows, 12% over an even split; with
  // the two largest alone the rest splits 714 / 601.
  CHECK(gemms_run_alone({1711, 1070, 714, 578, 21, 2}, 2) == 2);
  // Many small groups balance well whatever their sizes.
  std::vector<double> small;
  for (int i = 64; i > 0; --i) small.push_back(i);
  CHECK(gemms_run_alone(small, 2) == 0);
  CHECK(gemms_run_alone(small, 64) <= cpu::kMaxAlone);
  CHECK(cpu::side_by_side_time({3, 2, 2, 1}, 0, 2) == 4);
  CHECK(cpu::side_by_side_time({3, 2, 2, 1}, 1, 2) == 3);
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
// after its eviction, and two threads adding shapes to the full cache at once. On a CPU
// that widens bfloat16 to float32 (whose primitives are per layout, not per shape) the
// same shapes need one primitive.
void test_onednn_cache_bound() {
  g_case = "onednn_cache_bound";
  const int64_t shapes = int64_t(cpu::kOnednnCacheCapacity) + 44;
  const size_t before = cpu::onednn_cached_primitives();
  for (int64_t s = 0; s < shapes; ++s) CHECK(bf16_forward_exact(1 + s));
  const cpu::GemmCall four_rows{DType::bf16, DType::f32, 4,     8,       1,      nullptr,
                                false,       nullptr,    false, nullptr, nullptr, false};
  if (cpu::runs_widened(four_rows)) {
    CHECK(cpu::onednn_cached_primitives() <= before + 1);
    return;
  }
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

// A packed B (gemm.h's pack_b) gives the bits of the same call on B as given, whatever its
// layout, bias or output dtype; a packed B is refused by a call of another shape, and only
// bfloat16 calls with a row-major A have one (on an AMX CPU, or one that widens bfloat16 to
// float32, where the packed B is B widened: run under both), and on an AVX-512 CPU float32
// calls with B stored transposed (B copied row-major, which calls of kMinPackedRows rows or
// more read and shorter ones leave for B as given).
void test_packed_b_bits() {
  g_case = "packed_b_bits";
  const int64_t m = 300, k = 96, n = 80;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<cpu::bf16_t> lhs(m * k), rhs(k * n), bias(n);
  for (auto* v : {&lhs, &rhs, &bias})
    for (auto& x : *v) x = cpu::narrow<cpu::bf16_t>(normal(rng));
  std::vector<char> storage;
  for (bool transposed : {false, true})
    for (bool with_bias : {false, true})
      for (DType out : {DType::bf16, DType::f32}) {
        cpu::GemmCall call{DType::bf16, out,         m,       n,         k,      lhs.data(), false,
                           rhs.data(),  transposed, with_bias ? bias.data() : nullptr, nullptr, false};
        std::vector<float> given(m * n), packed(m * n, std::numeric_limits<float>::quiet_NaN());
        call.c = given.data();
        CHECK(cpu::gemm(call).ok());
        const std::optional<cpu::PackedB> b = cpu::pack_b(call, storage);
        CHECK(b.has_value() == cpu::cpu_packs_b());
        if (!b) continue;
        call.c = packed.data(), call.packed_b = &*b;
        CHECK(cpu::gemm(call).ok());
        CHECK(std::memcmp(given.data(), packed.data(), m * n * dtype_size(out)) == 0);
        call.accumulate = true;  // another primitive: the packed B's is not its kernel
        if (!cpu::cpu_widens_bf16()) CHECK(!cpu::gemm(call).ok());  // a widened B has none
      }
  cpu::GemmCall f32{DType::f32, DType::f32, m, n, k, lhs.data(), false, rhs.data(), false, nullptr, nullptr, false};
  CHECK(!cpu::pack_b(f32, storage).has_value());
  std::vector<float> a32(m * k), b32(n * k);
  for (auto* v : {&a32, &b32})
    for (auto& x : *v) x = normal(rng);
  for (int64_t rows : {m, cpu::kMinPackedRows - 1}) {
    cpu::GemmCall t{DType::f32, DType::f32, rows, n, k, a32.data(), false, b32.data(), true, nullptr, nullptr, false};
    std::vector<float> given(rows * n), packed(rows * n, std::numeric_limits<float>::quiet_NaN());
    t.c = given.data();
    CHECK(cpu::gemm(t).ok());
    const std::optional<cpu::PackedB> b = cpu::pack_b(t, storage);
    if (!b) continue;  // a CPU without AVX-512: B read as given
    t.c = packed.data(), t.packed_b = &*b;
    CHECK(cpu::gemm(t).ok());
    CHECK(std::memcmp(given.data(), packed.data(), rows * n * sizeof(float)) == 0);
  }
  cpu::GemmCall wgrad{DType::bf16, DType::f32, k, n, m, lhs.data(), true, rhs.data(), false, nullptr, nullptr, false};
  CHECK(!cpu::pack_b(wgrad, storage).has_value());
}

void test_workspace() {
  g_case = "workspace";
  for (int64_t g : {0, 1, 3, 64, 1000}) {
    const WorkspaceLayout l = workspace_layout(g);
    std::vector<std::pair<int64_t, int64_t>> arrays = {{l.window, 32}, {l.boundary, (g + 1) * 8}};
    for (const GemmArraysLayout& set : l.gemm) {
      arrays.push_back({set.action, g * 4});
      arrays.push_back({set.problem, g * 12});
      for (int i = 0; i < 4; ++i) arrays.push_back({set.ptr[i], g * 8});
      for (int i = 0; i < 4; ++i) arrays.push_back({set.ld[i], g * 8});
    }
    arrays.push_back({l.bytes, 0});
    for (size_t i = 0; i + 1 < arrays.size(); ++i) {
      CHECK(arrays[i].first % 16 == 0);
      CHECK(arrays[i].first + arrays[i].second <= arrays[i + 1].first);  // in order, no overlap
    }
    CHECK(grouped_matmul_workspace_bytes(Device::cuda, g) == l.bytes);
    CHECK(grouped_matmul_workspace_bytes(Device::cpu, g) == 0);
  }

  // Pointer and leading-dimension arithmetic of one group, in int64 past 2^31 elements.
  std::vector<int64_t> storage(workspace_layout(2).bytes / 8);
  const GemmArrays ws = workspace_view(storage.data(), 2).gemm[1];
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
  // A float32 output whose rows hold the bias: C is D.
  const GemmOperands prefilled{base, base + 1, base + 3, const_cast<char*>(base + 3), 2, 2, 4, 4};
  write_group(ws, 1, forward_problem({begin, begin + 5}, 1, k, n, true, true), prefilled);
  CHECK(ws.ptr[2][1] == ws.ptr[3][1] && ws.ld[2][1] == n);
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

// The sm_90a kernel's own workspace: the last region, aligned at run time to 128 bytes
// inside a caller's workspace that is only 16-byte aligned.
void test_kernel_workspace() {
  g_case = "kernel_workspace";
  for (int64_t g : {0, 1, 3, 1000}) {
    const WorkspaceLayout plain = workspace_layout(g);
    CHECK(plain.kernel == plain.bytes);  // no kernel workspace: nothing added
    for (int64_t kernel_bytes : {int64_t(1), int64_t(4096), int64_t(132) * 512}) {
      const WorkspaceLayout l = workspace_layout(g, kernel_bytes);
      const GemmArraysLayout& last = l.gemm[kGemmSets - 1];
      CHECK(l.window == plain.window && l.gemm[0].problem == plain.gemm[0].problem &&
            last.ld[3] == plain.gemm[kGemmSets - 1].ld[3]);
      CHECK(l.kernel == plain.kernel && l.kernel >= last.ld[3] + g * 8 && l.kernel % 16 == 0);
      CHECK(l.bytes >= l.kernel + kernel_bytes + kKernelWorkspaceAlignment - 16);
      std::vector<char> storage(l.bytes + 2 * kKernelWorkspaceAlignment);
      const uintptr_t a = kKernelWorkspaceAlignment, start = reinterpret_cast<uintptr_t>(storage.data());
      char* aligned = storage.data() + ((start + a - 1) / a * a - start);
      for (int64_t shift = 0; shift < kKernelWorkspaceAlignment; shift += 16) {  // every 16-byte alignment
        char* base = aligned + shift;
        const KernelWorkspace kw = kernel_workspace(base, l.bytes, g);
        const char* data = static_cast<const char*>(kw.data);
        CHECK(reinterpret_cast<uintptr_t>(data) % kKernelWorkspaceAlignment == 0);
        CHECK(data >= base + l.kernel && kw.bytes >= kernel_bytes && data + kw.bytes == base + l.bytes);
        // A workspace sized without the kernel's region leaves it nothing.
        CHECK(kernel_workspace(base, plain.bytes, g).bytes < kKernelWorkspaceAlignment);
      }
    }
  }
}

// Which kernel runs a call: on a compute capability 9.0 device of a build with sm_90a code,
// the Hopper kernel table's choice for the call's class, or what GROUPGEMM_CUDA_KERNEL
// names; the 2.x kernels elsewhere; and which calls the sm90 kernels take.
void test_kernel_choice() {
  g_case = "kernel_choice";
  auto policy = [](int major, int minor, const char* env, bool built, KernelPolicy want, int tile = 0) {
    const KernelChoice c = choose_gemm_kernel(major, minor, env, built);
    return c.status.ok() && c.policy == want && (want != KernelPolicy::sm90_tile || c.tile == Sm90Tile(tile));
  };
  CHECK(policy(9, 0, nullptr, true, KernelPolicy::hopper_default));
  CHECK(policy(9, 0, "", true, KernelPolicy::hopper_default));
  CHECK(policy(9, 0, nullptr, false, KernelPolicy::sm80));  // no sm_90a code in this build
  CHECK(policy(8, 0, nullptr, true, KernelPolicy::sm80));
  CHECK(policy(10, 0, nullptr, true, KernelPolicy::sm80));
  CHECK(policy(9, 0, "sm80", true, KernelPolicy::sm80));
  CHECK(policy(8, 6, "sm80", false, KernelPolicy::sm80));
  CHECK(policy(9, 0, "sm90", true, KernelPolicy::sm90_by_shape));
  CHECK(kNumSm90Tiles >= 1);
  for (int t = 0; t < kNumSm90Tiles; ++t) CHECK(policy(9, 0, kSm90TileNames[t], true, KernelPolicy::sm90_tile, t));
  std::vector<std::string> sm90_names{"sm90"};
  for (const char* tile : kSm90TileNames) sm90_names.push_back(tile);
  for (const std::string& sm90 : sm90_names) {
    for (auto [major, minor, built] : {std::tuple{9, 0, false}, std::tuple{8, 0, true},
                                       std::tuple{10, 0, true}, std::tuple{12, 0, true}}) {
      const KernelChoice c = choose_gemm_kernel(major, minor, sm90.c_str(), built);
      CHECK(!c.status.ok() && c.policy == KernelPolicy::sm80 &&
            c.status.message.find("GROUPGEMM_CUDA_KERNEL=" + sm90 + " needs") != std::string::npos);
    }
  }
  for (const char* bad : {"hopper", "sm90_128x128", "SM90"}) {
    const KernelChoice c = choose_gemm_kernel(9, 0, bad, true);
    CHECK(!c.status.ok() && c.status.message.find("one of sm80, sm90, " + std::string(kSm90TileNames[0])) !=
                                std::string::npos &&
          c.status.message.find(std::string(", not '") + bad + "'") != std::string::npos);
  }

  // A call's class: the smaller of its mean rows per group (M / G forward and dgrad, K
  // for the weight gradient) and its columns.
  auto gemm = [](GemmLayout layout, int64_t groups, int64_t max_m, int64_t n, DType in = DType::bf16) {
    return GroupedGemmCall{in, in, layout, groups, GemmC::none, max_m, n, 0, nullptr};
  };
  CHECK(smaller_side(gemm(GemmLayout::row_row, 8, 16384, 14336)) == 2048);
  CHECK(smaller_side(gemm(GemmLayout::row_col, 32, 16384, 2048)) == 512);
  CHECK(smaller_side(gemm(GemmLayout::row_row, 128, 16512, 1408)) == 129);
  CHECK(smaller_side(gemm(GemmLayout::row_row, 8, 16384, 128)) == 128);  // narrow output
  CHECK(smaller_side(gemm(GemmLayout::col_row, 128, 2048, 1408)) == 1408);  // wgrad: K rows whatever G
  CHECK(smaller_side(gemm(GemmLayout::row_row, 0, 16384, 1408)) == 1408);  // no groups: no division by 0

  // Each row of the table takes the calls up to its bound, the next row those just above,
  // the last row any size; the defaults and sm90 tiles are the table's, the named tile is
  // held whatever the class, and the 2.x kernels take what the sm90 kernels cannot run.
  const KernelChoice hopper = choose_gemm_kernel(9, 0, nullptr, true);
  const KernelChoice by_shape = choose_gemm_kernel(9, 0, "sm90", true);
  auto same = [](GemmKernelChoice a, GemmKernelChoice b) {
    return a.kernel == b.kernel && (a.kernel == GemmKernel::sm80 || a.tile == b.tile);
  };
  const size_t rows = std::size(kHopperChoices);
  CHECK(kHopperChoices[rows - 1].smaller_side_at_most == 0);
  for (size_t r = 0; r < rows; ++r) {
    const HopperChoice& row = kHopperChoices[r];
    const int64_t side = row.smaller_side_at_most ? row.smaller_side_at_most : 1 << 20;
    const GroupedGemmCall call = gemm(GemmLayout::row_row, 4, 4 * side, 1 << 21);
    CHECK(&hopper_choice(call) == &row);
    CHECK(same(kernel_for(hopper, call, true), row.default_kernel));
    CHECK(same(kernel_for(by_shape, call, true), {GemmKernel::sm90, row.sm90_tile}));
    if (row.smaller_side_at_most) CHECK(&hopper_choice(gemm(GemmLayout::row_row, 4, 4 * side + 4, 1 << 21)) != &row);
    for (int t = 0; t < kNumSm90Tiles; ++t) {
      const KernelChoice held = choose_gemm_kernel(9, 0, kSm90TileNames[t], true);
      CHECK(same(kernel_for(held, call, true), {GemmKernel::sm90, Sm90Tile(t)}));
      CHECK(same(kernel_for(held, call, false), {GemmKernel::sm80, Sm90Tile{}}));  // unaligned
      CHECK(same(kernel_for(held, gemm(GemmLayout::row_row, 4, 4 * side, 1 << 21, DType::f32), true),
                 {GemmKernel::sm80, Sm90Tile{}}));
    }
    CHECK(same(kernel_for(choose_gemm_kernel(8, 0, nullptr, true), call, true), {GemmKernel::sm80, Sm90Tile{}}));
  }

  auto call = [](DType in, GemmLayout layout, GemmC c) {
    return GroupedGemmCall{in, DType::f32, layout, 4, c, 64, 64, 0, nullptr};
  };
  for (DType in : {DType::bf16, DType::f16})
    for (GemmLayout layout : {GemmLayout::row_row, GemmLayout::row_col, GemmLayout::col_row}) {
      // Any C: none, the bias row (a broadcast epilogue), the output (accumulating, pre-filled bias).
      for (GemmC c : {GemmC::none, GemmC::bias_row, GemmC::output}) CHECK(sm90_runs(call(in, layout, c), true));
      CHECK(!sm90_runs(call(in, layout, GemmC::none), false));  // TMA needs 16-byte alignment
    }
  CHECK(!sm90_runs(call(DType::f32, GemmLayout::row_row, GemmC::none), true));  // exact fp32 stays on CUDA cores

  // The gathered GEMMs: the sm90 kernel only when asked for, for A's rows in a forward layout
  // or a weight gradient's gathered contraction into the inputs' type.
  for (GemmLayout layout : {GemmLayout::row_row, GemmLayout::row_col}) {
    const GroupedGemmCall forward = call(DType::bf16, layout, GemmC::none);
    CHECK(gathered_kernel_for(by_shape, forward, Gather::a_rows, true) == GemmKernel::sm90);
    CHECK(gathered_kernel_for(choose_gemm_kernel(9, 0, kSm90TileNames[0], true), forward, Gather::a_rows, true) ==
          GemmKernel::sm90);
    CHECK(gathered_kernel_for(hopper, forward, Gather::a_rows, true) == GemmKernel::sm80);  // not the default yet
    CHECK(gathered_kernel_for(by_shape, forward, Gather::a_rows, false) == GemmKernel::sm80);  // unaligned
    CHECK(gathered_kernel_for(by_shape, call(DType::f32, layout, GemmC::none), Gather::a_rows, true) ==
          GemmKernel::sm80);
    CHECK(gathered_kernel_for(choose_gemm_kernel(9, 0, "sm80", true), forward, Gather::a_rows, true) ==
          GemmKernel::sm80);
  }
  for (Gather contraction : {Gather::a_k, Gather::b_k}) {
    GroupedGemmCall wgrad = call(DType::bf16, GemmLayout::col_row, GemmC::none);
    CHECK(gathered_kernel_for(by_shape, wgrad, contraction, true) == GemmKernel::sm80);  // a float32 output
    wgrad.out_dtype = DType::bf16;
    CHECK(gathered_kernel_for(by_shape, wgrad, contraction, true) == GemmKernel::sm90);
    CHECK(gathered_kernel_for(hopper, wgrad, contraction, true) == GemmKernel::sm80);    // not the default yet
    CHECK(gathered_kernel_for(by_shape, wgrad, contraction, false) == GemmKernel::sm80);  // unaligned
    CHECK(gathered_kernel_for(by_shape, wgrad, Gather::a_rows, true) == GemmKernel::sm80);
    for (GemmLayout forward : {GemmLayout::row_row, GemmLayout::row_col}) {
      wgrad.layout = forward;
      CHECK(gathered_kernel_for(by_shape, wgrad, contraction, true) == GemmKernel::sm80);
    }
  }
}

// The sm90 kernel reads each operand through its 3.x stride (sm90_strides.h): one GEMM per
// layout computed that way from the workspace equals the GEMM the call describes.
void test_sm90_strides() {
  g_case = "sm90_strides";
  const int64_t rows = 5, k = 3, n = 4, begin = 2, local = 1;
  std::vector<double> lhs(16 * k), rhs(2 * k * n), grad(16 * n);
  for (size_t i = 0; i < lhs.size(); ++i) lhs[i] = double(i % 7) - 3;
  for (size_t i = 0; i < rhs.size(); ++i) rhs[i] = double(i % 5) - 2;
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = double(i % 3) - 1;
  for (GemmLayout layout : {GemmLayout::row_row, GemmLayout::row_col, GemmLayout::col_row}) {
    const bool wgrad = layout == GemmLayout::col_row;
    std::vector<double> out(wgrad ? 2 * k * n : 16 * n, 0.0);
    std::vector<int64_t> storage(workspace_layout(2).bytes / 8);
    const GemmArrays ws = workspace_view(storage.data(), 2).gemm[0];
    const GemmOperands ops{lhs.data(), wgrad ? grad.data() : rhs.data(), nullptr, out.data(), 8, 8, 8, 8};
    const RowRange r{begin, begin + rows};
    write_group(ws, local,
                wgrad ? wgrad_problem(r, local, k, n, false)
                      : forward_problem(r, local, k, n, layout == GemmLayout::row_col),
                ops);
    const int64_t pm = ws.problem[3 * local], pn = ws.problem[3 * local + 1], pk = ws.problem[3 * local + 2];
    CHECK(pm == (wgrad ? k : rows) && pn == n && pk == (wgrad ? rows : k));
    auto at = [&](int i, Sm90Operand op, int64_t a, int64_t b) {
      return static_cast<const double*>(ws.ptr[i][local])[sm90_offset(layout, op, ws.ld[i][local], a, b)];
    };
    bool same = true;
    for (int64_t i = 0; i < pm; ++i)
      for (int64_t j = 0; j < pn; ++j) {
        double sm90 = 0, want = 0;
        for (int64_t p = 0; p < pk; ++p) sm90 += at(0, Sm90Operand::a, i, p) * at(1, Sm90Operand::b, j, p);
        for (int64_t p = 0; p < pk; ++p) {
          if (wgrad)
            want += lhs[(begin + p) * k + i] * grad[(begin + p) * n + j];  // lhs_g^T @ grad_g
          else if (layout == GemmLayout::row_col)
            want += lhs[(begin + i) * k + p] * rhs[(local * n + j) * k + p];  // rhs[g] stored [n, k]
          else
            want += lhs[(begin + i) * k + p] * rhs[(local * k + p) * n + j];
        }
        double* d = static_cast<double*>(ws.ptr[3][local]) +
                    sm90_offset(layout, Sm90Operand::d, ws.ld[3][local], i, j);
        const double* d_expected = wgrad ? &out[(local * k + i) * n + j] : &out[(begin + i) * n + j];
        same = same && sm90 == want && d == d_expected;
      }
    CHECK(same);
    CHECK(ws.ptr[2][local] == ws.ptr[3][local] && ws.ld[2][local] == ws.ld[3][local]);  // no C: D's
  }
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

// A training step's launches on the CUDA path: a forward is 2 (setup, GEMM); a forward
// and its backward with every gradient 5, and 6 with a bias gradient.
void test_launch_counts() {
  g_case = "launch_counts";
  const int64_t m = 64, k = 16, n = 24, G = 4;
  std::vector<float> lhs(m * k, 1.0f), rhs(G * k * n, 1.0f), bias(G * n, 1.0f), out(m * n), dout(m * n, 1.0f);
  std::vector<float> dlhs(m * k), drhs(G * k * n), dbias(G * n);
  const int64_t sizes[] = {10, 0, 30, 20};
  for (bool with_bias : {false, true}) {
    emulated::Workspace workspace(G);
    emulated::HostLauncher forward(256);
    MatmulArgs a;
    a.lhs = lhs.data(), a.rhs = rhs.data(), a.bias = with_bias ? bias.data() : nullptr, a.out = out.data();
    a.m = m, a.k = k, a.n = n, a.num_groups = G, a.group_sizes = {sizes, IndexType::i64, G};
    CHECK(enqueue_grouped_matmul(a, workspace.data(), forward).ok());
    CHECK(forward.record().launches == 2);
    emulated::HostLauncher backward(256);
    BackwardArgs b;
    b.lhs = lhs.data(), b.rhs = rhs.data(), b.grad = dout.data();
    b.dlhs = dlhs.data(), b.drhs = drhs.data(), b.dbias = with_bias ? dbias.data() : nullptr;
    b.m = m, b.k = k, b.n = n, b.num_groups = G, b.group_sizes = a.group_sizes;
    CHECK(enqueue_grouped_matmul_backward(b, workspace.data(), backward).ok());
    CHECK(forward.record().launches + backward.record().launches == (with_bias ? 6 : 5));
  }
}

// Over all the runs: both GEMM kernels ran for each 16-bit dtype, forward and wgrad;
// float32 only ever ran its main one; a bias was pre-filled for a float32 output.
void check_gemm_paths_seen() {
  g_case = "gemm_paths_seen";
  for (DType t : {DType::bf16, DType::f16}) {
    CHECK(g_forward_paths[int(t)].aligned > 0 && g_forward_paths[int(t)].unaligned > 0);
    CHECK(g_wgrad_paths[int(t)].aligned > 0 && g_wgrad_paths[int(t)].unaligned > 0);
  }
  const int f32 = int(DType::f32);
  CHECK(g_forward_paths[f32].aligned > 0 && g_forward_paths[f32].unaligned == 0);
  CHECK(g_wgrad_paths[f32].aligned > 0 && g_wgrad_paths[f32].unaligned == 0);
  CHECK(g_prefilled_bias_runs > 0);
}

// ---- the expert layer: permute, unpermute, activation -----------------------------

// One routing: T tokens of H columns, k choices each among E experts. `indices` holds
// the T*k raw expert indices (any int64 value; out of [0, E) is dropped).
struct RouteCase {
  const char* name;
  int64_t t, k, h, e;
  std::vector<int64_t> indices;
};

// What permute must produce, from a naive pass per bucket.
struct RouteExpect {
  std::vector<int32_t> group_sizes, row_map;
  std::vector<int64_t> token_of_row;  // -1: a dropped slot's row (exact zeros)
};

RouteExpect expected_route(const RouteCase& c) {
  const int64_t slots = c.t * c.k;
  RouteExpect x{std::vector<int32_t>(c.e, 0), std::vector<int32_t>(slots, -1), {}};
  for (int64_t e = 0; e < c.e; ++e)
    for (int64_t s = 0; s < slots; ++s)
      if (c.indices[s] == e) {
        ++x.group_sizes[e];
        x.row_map[s] = int32_t(x.token_of_row.size());
        x.token_of_row.push_back(s / c.k);
      }
  while (int64_t(x.token_of_row.size()) < slots) x.token_of_row.push_back(-1);
  return x;
}

// permute through the public API (the CPU's one chunk), or the CPU backend running the
// CUDA backend's steps with `chunks` chunks (chunks < 0: the CUDA chunk count itself).
using PermuteRunner = std::function<Status(const PermuteArgs&)>;

PermuteRunner permute_runner(int64_t chunks) {
  if (chunks == 0) return [](const PermuteArgs& a) { return permute(a, ExecContext{}); };
  return [chunks](const PermuteArgs& a) {
    const int64_t c = chunks > 0 ? chunks : permute_chunks(a.num_tokens * a.top_k, a.num_experts);
    return cpu::permute_in_chunks(a, c);
  };
}

bool all_zero_bytes(const void* p, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i)
    if (static_cast<const unsigned char*>(p)[i] != 0) return false;
  return true;
}

template <typename T>
void run_permute_case(const RouteCase& c, IndexType index_type, const PermuteRunner& run,
                      const char* runner) {
  g_case = std::string(c.name) + " permute " + dtype_name(dtype_of<T>()) + " " +
           (index_type == IndexType::i32 ? "int32 " : "int64 ") + runner;
  const int64_t slots = c.t * c.k;
  std::mt19937 rng(3);
  const std::vector<T> tokens = random_vec<T>(c.t * c.h, rng);
  std::vector<int32_t> indices32(c.indices.size());
  for (size_t i = 0; i < c.indices.size(); ++i) {  // int32 indices: clamp into int32's range
    const int64_t v = c.indices[i];
    indices32[i] = int32_t(std::max<int64_t>(std::min<int64_t>(v, INT32_MAX), INT32_MIN));
  }
  RouteCase as_stored = c;
  if (index_type == IndexType::i32) as_stored.indices.assign(indices32.begin(), indices32.end());
  const RouteExpect want = expected_route(as_stored);
  std::vector<T> permuted = nan_vec<T>(slots * c.h);
  std::vector<int32_t> group_sizes(c.e, 12345), row_map(slots, 12345);
  PermuteArgs a;
  a.dtype = dtype_of<T>();
  a.tokens = tokens.data();
  a.expert_indices = {index_type == IndexType::i32 ? static_cast<const void*>(indices32.data())
                                                   : static_cast<const void*>(c.indices.data()),
                      index_type, slots};
  a.permuted = permuted.data(), a.group_sizes = group_sizes.data(), a.row_map = row_map.data();
  a.num_tokens = c.t, a.top_k = c.k, a.hidden = c.h, a.num_experts = c.e;
  CHECK(run(a).ok());
  CHECK(group_sizes == want.group_sizes);
  CHECK(row_map == want.row_map);
  for (int64_t r = 0; r < slots; ++r) {
    const int64_t tok = want.token_of_row[r];
    if (tok >= 0)
      CHECK(c.h == 0 || std::memcmp(&permuted[r * c.h], &tokens[tok * c.h], c.h * sizeof(T)) == 0);  // bits
    else
      CHECK(all_zero_bytes(permuted.data() + r * c.h, c.h * sizeof(T)));  // +0.0, not just == 0
  }
}

// Probabilities (or weights) of the slots in storage type P.
template <typename P>
std::vector<P> random_probs(int64_t count, std::mt19937& rng) {
  std::uniform_real_distribution<double> d(0.0, 1.0);
  std::vector<P> v(count);
  for (auto& x : v) x = from_double<P>(d(rng));
  return v;
}

// unpermute and its backward on permute's row_map plus entries outside [0, R) (dropped)
// and entries naming a row another slot names too, in value type T with probs of type P
// (or none), against the double reference. The backward runs through the API, through
// the CPU backend with the CUDA backend's sort chunking (3, 256 and its own chunk count)
// and for one output at a time: every run gives the API's bits.
template <typename T, typename P>
void run_unpermute_case(const RouteCase& c, bool with_probs) {
  g_case = std::string(c.name) + " unpermute " + dtype_name(dtype_of<T>()) +
           (with_probs ? std::string(" probs ") + dtype_name(dtype_of<P>()) : std::string(" no probs"));
  const int64_t slots = c.t * c.k, rows = slots, h = c.h;
  std::vector<int32_t> row_map = expected_route(c).row_map;
  // A few foreign entries: R itself and huge values add nothing, like -1; every fourth
  // slot names the row of the slot two before it (a row twice, or a dropped slot again).
  for (int64_t s = 0; s < slots; s += 5)
    if (row_map[s] < 0) row_map[s] = (s % 2) ? int32_t(rows) : INT32_MAX;
  for (int64_t s = 3; s < slots; s += 4) row_map[s] = row_map[s - 2];
  std::mt19937 rng(11);
  const std::vector<T> permuted = random_vec<T>(rows * h, rng), dout = random_vec<T>(c.t * h, rng);
  const std::vector<P> probs = random_probs<P>(slots, rng);
  auto prob = [&](int64_t s) { return with_probs ? to_double(probs[s]) : 1.0; };
  auto mapped = [&](int64_t s) { return row_map[s] >= 0 && row_map[s] < rows; };

  std::vector<T> out = nan_vec<T>(c.t * h);
  UnpermuteArgs u;
  u.dtype = dtype_of<T>(), u.probs_dtype = dtype_of<P>();
  u.permuted = permuted.data(), u.row_map = row_map.data(), u.probs = with_probs ? probs.data() : nullptr;
  u.out = out.data(), u.num_rows = rows, u.num_tokens = c.t, u.top_k = c.k, u.hidden = h;
  CHECK(unpermute(u, ExecContext{}).ok());
  for (int64_t t = 0; t < c.t; ++t)
    for (int64_t j = 0; j < h; ++j) {
      double want = 0;
      for (int64_t i = 0; i < c.k; ++i)
        if (mapped(t * c.k + i))
          want += prob(t * c.k + i) * to_double(permuted[row_map[t * c.k + i] * h + j]);
      CHECK(close(out[t * h + j], want));
    }

  std::vector<T> dpermuted = nan_vec<T>(rows * h);
  std::vector<P> dprobs = nan_vec<P>(slots);
  UnpermuteBackwardArgs b;
  b.dtype = dtype_of<T>(), b.probs_dtype = dtype_of<P>();
  b.dout = dout.data(), b.permuted = permuted.data(), b.row_map = row_map.data();
  b.probs = with_probs ? probs.data() : nullptr, b.dprobs = with_probs ? dprobs.data() : nullptr;
  b.dpermuted = dpermuted.data(), b.num_rows = rows, b.num_tokens = c.t, b.top_k = c.k, b.hidden = h;
  CHECK(unpermute_backward(b, ExecContext{}).ok());
  std::vector<double> want_dpermuted(rows * h, 0.0);
  std::vector<bool> referenced(rows, false);
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t t = s / c.k;
    if (mapped(s)) {
      referenced[row_map[s]] = true;
      for (int64_t j = 0; j < h; ++j)
        want_dpermuted[row_map[s] * h + j] += prob(s) * to_double(dout[t * h + j]);
    }
    if (!with_probs) continue;
    if (!mapped(s)) {
      CHECK(all_zero_bytes(&dprobs[s], sizeof(P)));
      continue;
    }
    double want = 0;
    for (int64_t j = 0; j < h; ++j)
      want += to_double(permuted[row_map[s] * h + j]) * to_double(dout[t * h + j]);
    CHECK(close(dprobs[s], want) || std::fabs(to_double(dprobs[s]) - want) <= 1e-3 * std::sqrt(double(h)));
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (!referenced[r]) CHECK(all_zero_bytes(dpermuted.data() + r * h, h * sizeof(T)));
    for (int64_t j = 0; j < h; ++j) CHECK(close(dpermuted[r * h + j], want_dpermuted[r * h + j]));
  }

  auto same_bits = [](const auto& a, const auto& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
  };
  for (int64_t chunks : {int64_t(3), int64_t(256), row_sort_chunks(slots)}) {
    std::vector<T> again = nan_vec<T>(rows * h);
    UnpermuteBackwardArgs rows_only = b;
    rows_only.dpermuted = again.data(), rows_only.dprobs = nullptr;
    CHECK(cpu::unpermute_backward_in_chunks(rows_only, chunks).ok());
    CHECK(same_bits(again, dpermuted));
  }
  if (with_probs) {
    std::vector<P> again = nan_vec<P>(slots);
    UnpermuteBackwardArgs dots_only = b;
    dots_only.dpermuted = nullptr, dots_only.probs = nullptr, dots_only.dprobs = again.data();
    CHECK(unpermute_backward(dots_only, ExecContext{}).ok());
    CHECK(same_bits(again, dprobs));
  }
}

// unpermute's backward with rows split over 1, 2 and 3 threads (each thread's first row
// finds its slots by binary search, the rest by walking on): the same bits, and each row
// the sum of the slots naming it, in slot order.
void test_unpermute_backward_bits_on_any_thread_count() {
  g_case = "unpermute_backward_thread_count";
  const int64_t t = 1500, k = 2, rows = t * k, h = 17;  // rows * h over the parallel threshold
  std::mt19937 rng(13);
  std::uniform_int_distribution<int32_t> row(-2, int32_t(rows) + 1);  // some outside [0, R)
  std::vector<int32_t> row_map(t * k);
  for (auto& r : row_map) r = row(rng);
  for (int64_t s = 0; s < t * k; s += 7) row_map[s] = 5;  // row 5 named by many slots
  const std::vector<float> dout = random_vec<float>(t * h, rng), probs = random_probs<float>(t * k, rng);
  UnpermuteBackwardArgs b;
  b.dout = dout.data(), b.row_map = row_map.data(), b.probs = probs.data();
  b.num_rows = rows, b.num_tokens = t, b.top_k = k, b.hidden = h;
  const int threads = omp_get_max_threads();
  std::vector<std::vector<float>> results;
  for (int n : {1, 2, 3}) {
    omp_set_num_threads(n);
    results.emplace_back(nan_vec<float>(rows * h));
    b.dpermuted = results.back().data();
    CHECK(unpermute_backward(b, ExecContext{}).ok());
  }
  omp_set_num_threads(threads);
  for (const auto& r : results) CHECK(std::memcmp(r.data(), results[0].data(), r.size() * sizeof(float)) == 0);
  for (int64_t j = 0; j < h; ++j) {
    float want = 0;  // row 5: the float32 sum in slot order, the first term the product itself
    bool first = true;
    for (int64_t s = 0; s < t * k; ++s)
      if (row_map[s] == 5) {
        const float term = probs[s] * dout[s / k * h + j];
        want = first ? term : want + term;
        first = false;
      }
    CHECK(results[0][5 * h + j] == want);
  }
}

// Small integers: every float32 sum is exact, so unpermute(permute(x)) is exactly the
// kept-choice count times x, and weighted sums are exact too.
void test_unpermute_exact() {
  g_case = "unpermute_exact";
  const int64_t t = 6, k = 3, h = 5, e = 4, slots = t * k;
  const std::vector<int64_t> indices = {0, 1, 2, 3, 3, -1, 2, 2, 9, 1, 0, 3, -4, -4, -4, 0, 1, 2};
  std::vector<cpu::bf16_t> tokens(t * h), permuted(slots * h), back(t * h);
  for (int64_t i = 0; i < t * h; ++i) tokens[i] = cpu::narrow<cpu::bf16_t>(float(i % 7 - 3));
  std::vector<int32_t> sizes(e), row_map(slots);
  PermuteArgs p;
  p.dtype = DType::bf16, p.tokens = tokens.data(), p.expert_indices = {indices.data(), IndexType::i64, slots};
  p.permuted = permuted.data(), p.group_sizes = sizes.data(), p.row_map = row_map.data();
  p.num_tokens = t, p.top_k = k, p.hidden = h, p.num_experts = e;
  CHECK(permute(p, ExecContext{}).ok());
  CHECK((sizes == std::vector<int32_t>{3, 3, 4, 3}));
  UnpermuteArgs u;
  u.dtype = DType::bf16, u.permuted = permuted.data(), u.row_map = row_map.data(), u.out = back.data();
  u.num_rows = slots, u.num_tokens = t, u.top_k = k, u.hidden = h;
  CHECK(unpermute(u, ExecContext{}).ok());
  for (int64_t i = 0; i < t; ++i) {
    int kept = 0;
    for (int64_t j = 0; j < k; ++j) kept += indices[i * k + j] >= 0 && indices[i * k + j] < e;
    for (int64_t c = 0; c < h; ++c) CHECK(to_double(back[i * h + c]) == kept * to_double(tokens[i * h + c]));
  }
  std::vector<float> probs(slots);
  for (int64_t s = 0; s < slots; ++s) probs[s] = float(s % 4) * 0.25f;
  u.probs = probs.data(), u.probs_dtype = DType::f32;
  CHECK(unpermute(u, ExecContext{}).ok());
  for (int64_t i = 0; i < t; ++i)
    for (int64_t c = 0; c < h; ++c) {
      double want = 0;
      for (int64_t j = 0; j < k; ++j)
        if (row_map[i * k + j] >= 0) want += probs[i * k + j] * to_double(tokens[i * h + c]);
      CHECK(to_double(back[i * h + c]) == want);
    }
}

// dprobs' order: lane partials over h = l, l + 32, ..., folded pairwise by halving.
void test_dot_order() {
  g_case = "dot_order";
  const int64_t n = 100;
  std::vector<float> x(n), y(n);
  std::mt19937 rng(5);
  std::normal_distribution<float> d;
  for (int64_t i = 0; i < n; ++i) x[i] = d(rng), y[i] = d(rng);
  float lanes[kDotLanes], want_lanes[kDotLanes];
  for (int l = 0; l < kDotLanes; ++l) {
    lanes[l] =
        dot_lane_partial<float>(l, n, [&](int64_t i) { return x[i]; }, [&](int64_t i) { return y[i]; });
    float acc = 0;
    for (int64_t i = l; i < n; i += 32) {
      const float product = x[i] * y[i];
      acc = acc + product;
    }
    want_lanes[l] = acc;
    CHECK(lanes[l] == want_lanes[l]);
  }
  for (int offset = 16; offset >= 1; offset /= 2)
    for (int l = 0; l < offset; ++l) want_lanes[l] += want_lanes[l + offset];
  CHECK(fold_dot_lanes(lanes) == want_lanes[0]);
}

// The permute steps directly: the chunking, the CUDA chunk count and its workspace.
void test_permute_steps() {
  g_case = "permute_steps";
  CHECK(slot_chunk(0, 1, 10).begin == 0 && slot_chunk(0, 1, 10).end == 10);
  CHECK(slot_chunk(2, 3, 10).begin == 8 && slot_chunk(2, 3, 10).end == 10);
  CHECK(slot_chunk(200, 256, 10).rows() == 0);  // trailing chunks are empty
  CHECK(slot_chunk(0, 1, 0).rows() == 0);
  const int64_t big = std::numeric_limits<int64_t>::max();
  const int64_t raw[] = {0, 3, -1, 4, big, std::numeric_limits<int64_t>::min(), int64_t(1) << 40};
  const IndexArray idx{raw, IndexType::i64, 7};
  const int64_t want[] = {0, 3, 4, 4, 4, 4, 4};
  for (int i = 0; i < 7; ++i) CHECK(slot_bucket(idx, i, 4) == want[i]);
  CHECK(slot_bucket(idx, 0, 0) == 0);  // E = 0: bucket 0 is the dropped one
  CHECK(permute_chunks(0, 8) == 1);
  CHECK(permute_chunks(100, 8) == 7);
  CHECK(permute_chunks(int64_t(1) << 30, 255) == kPermuteMaxCountEntries / 256);
  int32_t scanned[] = {3, 0, 2, 5};
  CHECK(exclusive_scan_in_place(scanned, 4) == 10);
  CHECK(scanned[0] == 0 && scanned[1] == 3 && scanned[2] == 3 && scanned[3] == 5);
  CHECK(permute_chunks(1000, int64_t(1) << 30) == 1);  // never below one chunk
  for (int64_t slots : {0, 1, 17, 4096, 1 << 20})
    for (int64_t e : {0, 1, 8, 300}) {
      const PermuteWorkspaceLayout l = permute_workspace_layout(slots, e);
      CHECK(l.kept_rows % 16 == 0 && l.bucket_start % 16 == 0 && l.counts % 16 == 0 && l.bytes % 16 == 0);
      CHECK(l.bucket_start >= l.kept_rows + 4 && l.counts >= l.bucket_start + (e + 1) * 4);
      CHECK(l.bytes >= l.counts + count_entries(e, l.chunks) * 4);
      CHECK(count_entries(e, l.chunks) <= std::max<int64_t>(kPermuteMaxCountEntries, e + 1));
      CHECK(permute_workspace_bytes(Device::cuda, slots, e) == l.bytes);
      CHECK(permute_workspace_bytes(Device::cpu, slots, e) == 0);
    }
  // unpermute's backward: the row keys, the radix passes and their workspace.
  CHECK(row_key(3, 5) == 3 && row_key(5, 5) == 5 && row_key(-1, 5) == 5 && row_key(INT32_MAX, 5) == 5);
  CHECK(dropped_row_key(big) == int64_t(1) << 31 && row_key(INT32_MAX, big) == INT32_MAX);
  CHECK(row_sort_passes(0) == 1 && row_sort_passes(255) == 1 && row_sort_passes(256) == 2);
  CHECK(row_sort_passes(int64_t(1) << 24) == 4 && row_sort_passes(big) == 4);
  for (int64_t slots : {0, 1, 17, 4096, 1 << 20}) {
    const RowSortWorkspaceLayout l = row_sort_workspace_layout(slots);
    CHECK(l.counts % 16 == 0 && l.order[0] % 16 == 0 && l.order[1] % 16 == 0 && l.bytes % 16 == 0);
    CHECK(l.counts >= kRowDigitBuckets * 4 && l.order[0] >= l.counts + kRowDigitBuckets * l.chunks * 4);
    CHECK(l.order[1] >= l.order[0] + slots * 4 && l.bytes >= l.order[1] + slots * 4);
    CHECK(kRowDigitBuckets * l.chunks <= kPermuteMaxCountEntries && l.chunks == row_sort_chunks(slots));
    CHECK(unpermute_backward_workspace_bytes(Device::cuda, slots) == l.bytes);
    CHECK(unpermute_backward_workspace_bytes(Device::cpu, slots) == 0);
  }
}

// The router counts a NaN logit as -inf in both softmax modes: the same choices,
// probabilities, gradients and tangents as with the expert masked, all finite.
void test_router_nan_is_masked() {
  g_case = "router_nan_is_masked";
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float with_nan[] = {0.5f, nan, 2.0f, -1.0f, nan}, masked[] = {0.5f, -inf, 2.0f, -1.0f, -inf};
  const float dprobs[] = {0.3f, -0.7f, 1.1f}, tlogits[] = {0.2f, 0.4f, -0.6f, 1.0f, -0.3f};
  for (bool renormalize : {true, false}) {
    int32_t idx_a[3], idx_b[3];
    float probs_a[3], probs_b[3], dl_a[5], dl_b[5], tp_a[3], tp_b[3];
    auto run = [&](const float* l, int32_t* idx, float* probs, float* dl, float* tp) {
      auto logit = [&](int64_t e) { return l[e]; };
      softmax_topk_row<float>(logit, 5, 3, renormalize, idx, probs);
      softmax_topk_backward_row<float>(
          logit, 5, 3, renormalize, idx, [&](int64_t j) { return dprobs[j]; },
          [&](int64_t e, float v) { dl[e] = v; });
      softmax_topk_tangent_row<float>(
          logit, 5, 3, renormalize, idx, [&](int64_t e) { return tlogits[e]; }, tp);
    };
    run(with_nan, idx_a, probs_a, dl_a, tp_a);
    run(masked, idx_b, probs_b, dl_b, tp_b);
    CHECK(idx_a[0] == 2 && idx_a[1] == 0 && idx_a[2] == 3);
    CHECK(std::memcmp(idx_a, idx_b, sizeof idx_a) == 0 && std::memcmp(probs_a, probs_b, sizeof probs_a) == 0);
    CHECK(std::memcmp(dl_a, dl_b, sizeof dl_a) == 0 && std::memcmp(tp_a, tp_b, sizeof tp_a) == 0);
    for (int e : {1, 4}) CHECK(all_zero_bytes(&dl_a[e], sizeof(float)));  // +0.0
    for (float p : probs_a) CHECK(std::isfinite(p) && p > 0);
    CHECK(std::fabs(probs_a[0] + probs_a[1] + probs_a[2] - 1.0f) < 1e-6f);  // no other expert is unmasked
  }
}

// The backward and the tangent take their indices from the caller: an index outside
// [0, E) is a dropped slot, exactly as -1 is, and nothing reads past the row. The logits
// and their tangents sit in longer buffers with a tail of 3 and NaN, so a read past E
// would change the results.
void test_router_out_of_range_index_is_dropped() {
  g_case = "router_out_of_range_index_is_dropped";
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float row[] = {0.5f, 1.5f, 2.0f, -1.0f, 3.0f, 3.0f, 3.0f, 3.0f};
  const float dprobs[] = {0.3f, -0.7f, 1.1f}, tlogits[] = {0.2f, 0.4f, -0.6f, 1.0f, nan, nan, nan, nan};
  auto logit = [&](int64_t e) { return row[e]; };
  for (bool renormalize : {true, false})
    for (int32_t bad : {4, 7, INT32_MAX, -5}) {
      const int32_t given[3] = {2, bad, 0}, dropped[3] = {2, -1, 0};
      float dl_a[4], dl_b[4], tp_a[3], tp_b[3];
      for (auto [idx, dl, tp] : {std::tuple{given, dl_a, tp_a}, std::tuple{dropped, dl_b, tp_b}}) {
        softmax_topk_backward_row<float>(
            logit, 4, 3, renormalize, idx, [&](int64_t j) { return dprobs[j]; },
            [&, dl = dl](int64_t e, float v) { dl[e] = v; });
        softmax_topk_tangent_row<float>(
            logit, 4, 3, renormalize, idx, [&](int64_t e) { return tlogits[e]; }, tp);
      }
      CHECK(std::memcmp(dl_a, dl_b, sizeof dl_a) == 0 && std::memcmp(tp_a, tp_b, sizeof tp_a) == 0);
      CHECK(all_zero_bytes(&tp_a[1], sizeof(float)));
      for (float v : dl_a) CHECK(std::isfinite(v));
      // A row whose first slot is out of range is dropped whole: every gradient +0.0.
      const int32_t first_bad[3] = {bad, 1, 0};
      softmax_topk_backward_row<float>(
          logit, 4, 3, renormalize, first_bad, [&](int64_t j) { return dprobs[j]; },
          [&](int64_t e, float v) { dl_a[e] = v; });
      softmax_topk_tangent_row<float>(
          logit, 4, 3, renormalize, first_bad, [&](int64_t e) { return tlogits[e]; }, tp_a);
      CHECK(all_zero_bytes(dl_a, sizeof dl_a) && all_zero_bytes(tp_a, sizeof tp_a));
    }
}

// Each activation and its derivative, independently of activation.h.
double ref_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double ref_phi_cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }
double ref_act(Activation kind, double x, double up) {
  switch (kind) {
    case Activation::swiglu: return x * ref_sigmoid(x) * up;
    case Activation::gelu: return x * ref_phi_cdf(x);
    case Activation::relu: return x > 0 ? x : 0.0;
    case Activation::silu: return x * ref_sigmoid(x);
  }
  return 0;
}
double ref_act_grad(Activation kind, double x, double up, bool wrt_up) {
  const double s = ref_sigmoid(x), dsilu = s * (1 + x * (1 - s));
  switch (kind) {
    case Activation::swiglu: return wrt_up ? x * s : up * dsilu;
    case Activation::gelu: return ref_phi_cdf(x) + x * std::exp(-x * x / 2) / std::sqrt(2 * M_PI);
    case Activation::relu: return x > 0 ? 1.0 : 0.0;
    case Activation::silu: return dsilu;
  }
  return 0;
}

const Activation kActivations[] = {Activation::swiglu, Activation::gelu, Activation::relu, Activation::silu};
const char* activation_name(Activation k) {
  const char* names[] = {"swiglu", "gelu", "relu", "silu"};
  return names[int(k)];
}

// Forward and backward over rows of random values, a zero row (stays exactly zero) and
// special points (0, +-large).
template <typename T>
void run_activation_case(Activation kind) {
  g_case = std::string("activation ") + activation_name(kind) + " " + dtype_name(dtype_of<T>());
  const int64_t m = 5, f = 6, f_in = kind == Activation::swiglu ? 2 * f : f;
  std::mt19937 rng(9);
  std::vector<T> h = random_vec<T>(m * f_in, rng), dout = random_vec<T>(m * f, rng);
  for (int64_t j = 0; j < f_in; ++j) h[2 * f_in + j] = from_double<T>(0.0);  // a padding row
  const double special[] = {0.0, 12.0, -12.0, 3.5, -0.5, 1e-3};
  for (int64_t j = 0; j < 6; ++j) h[4 * f_in + j] = from_double<T>(special[j]);
  std::vector<T> out = nan_vec<T>(m * f), dh = nan_vec<T>(m * f_in);
  ActivationArgs a;
  a.dtype = dtype_of<T>(), a.kind = kind, a.h = h.data(), a.out = out.data(), a.rows = m,
  a.in_features = f_in;
  CHECK(activation(a, ExecContext{}).ok());
  ActivationBackwardArgs b;
  b.dtype = dtype_of<T>(), b.kind = kind, b.dout = dout.data(), b.h = h.data(), b.dh = dh.data();
  b.rows = m, b.in_features = f_in;
  CHECK(activation_backward(b, ExecContext{}).ok());
  const bool swiglu = kind == Activation::swiglu;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double x = to_double(h[r * f_in + j]), up = swiglu ? to_double(h[r * f_in + f + j]) : 0.0;
      const double g = to_double(dout[r * f + j]);
      CHECK(close(out[r * f + j], ref_act(kind, x, up)));
      CHECK(close(dh[r * f_in + j], g * ref_act_grad(kind, x, up, false)));
      if (swiglu) CHECK(close(dh[r * f_in + f + j], g * ref_act_grad(kind, x, up, true)));
    }
  CHECK(all_zero_bytes(&out[2 * f], f * sizeof(T)));  // f(0) = 0 exactly
}

// activation.h's derivatives against central differences of its own forward, in double.
void test_activation_derivatives() {
  g_case = "activation_derivatives";
  for (Activation kind : kActivations)
    for (double x : {-4.0, -1.3, -0.2, 0.3, 0.9, 2.5, 6.0})
      for (double up : {-1.5, 0.7}) {
        const double eps = 1e-6;
        const ActivationGrad<double> g = activation_backward_at(kind, 1.0, x, up);
        const double dx =
            (activation_forward(kind, x + eps, up) - activation_forward(kind, x - eps, up)) / (2 * eps);
        CHECK(std::fabs(g.dx - dx) <= 1e-6);
        if (kind == Activation::swiglu) {
          const double dup =
              (activation_forward(kind, x, up + eps) - activation_forward(kind, x, up - eps)) / (2 * eps);
          CHECK(std::fabs(g.dup - dup) <= 1e-6);
        }
      }
  CHECK(activation_backward_at(Activation::relu, 1.0, 0.0, 0.0).dx == 0.0);  // relu'(0) = 0
  for (Activation kind : kActivations) CHECK(activation_forward(kind, 0.0f, 0.0f) == 0.0f);
}

std::vector<int64_t> random_indices(int64_t count, int64_t lo, int64_t hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> d(lo, hi);
  std::vector<int64_t> v(count);
  for (auto& x : v) x = d(rng);
  return v;
}

std::vector<RouteCase> route_cases() {
  const int64_t big = std::numeric_limits<int64_t>::max(), small = std::numeric_limits<int64_t>::min();
  std::vector<RouteCase> cases;
  for (int64_t k = 1; k <= 4; ++k)  // indices in [-1, E]: some dropped on both sides
    cases.push_back({"random_k", 37, k, 5, 6, random_indices(37 * k, -1, 6, uint32_t(k))});
  cases.push_back({"t_zero", 0, 2, 4, 3, {}});
  cases.push_back({"k_zero", 4, 0, 4, 3, {}});
  cases.push_back({"h_zero", 5, 2, 0, 3, random_indices(10, 0, 2, 1)});
  cases.push_back({"e_zero", 4, 2, 3, 0, {0, 1, -1, 0, 2, 0, 0, 5}});
  cases.push_back({"one_expert", 9, 2, 3, 4, std::vector<int64_t>(18, 2)});
  cases.push_back({"all_dropped", 6, 2, 3, 4, {-1, 4, 7, -9, 100, -1, 4, 4, -2, 5, 6, 1000}});
  cases.push_back(
      {"huge_indices", 3, 3, 2, 5, {big, 1, small, int64_t(1) << 40, 4, -(int64_t(1) << 33), 0, big - 1, 2}});
  cases.push_back({"same_expert_twice", 4, 3, 3, 3, {1, 1, 0, 2, 2, 2, 0, 1, 0, 1, 1, 1}});
  cases.push_back({"many_slots", 700, 2, 3, 9, random_indices(1400, -2, 10, 7)});
  return cases;
}

void test_permute_cases() {
  const std::pair<int64_t, const char*> runners[] = {
      {0, "api"}, {1, "chunks 1"}, {3, "chunks 3"}, {256, "chunks 256"}, {-1, "cuda chunk count"}};
  for (const RouteCase& c : route_cases()) {
    for (const auto& [chunks, name] : runners)
      for (IndexType it : {IndexType::i32, IndexType::i64}) {
        const PermuteRunner run = permute_runner(chunks);
        run_permute_case<double>(c, it, run, name);
        run_permute_case<float>(c, it, run, name);
        run_permute_case<cpu::bf16_t>(c, it, run, name);
        run_permute_case<cpu::f16_t>(c, it, run, name);
      }
    for (bool probs : {false, true}) {
      run_unpermute_case<double, double>(c, probs);
      run_unpermute_case<double, float>(c, probs);
      run_unpermute_case<float, float>(c, probs);
      run_unpermute_case<cpu::bf16_t, cpu::bf16_t>(c, probs);
      run_unpermute_case<cpu::bf16_t, float>(c, probs);
      run_unpermute_case<cpu::f16_t, cpu::f16_t>(c, probs);
      run_unpermute_case<cpu::f16_t, float>(c, probs);
    }
  }
  for (Activation kind : kActivations) {
    run_activation_case<double>(kind);
    run_activation_case<float>(kind);
    run_activation_case<cpu::bf16_t>(kind);
    run_activation_case<cpu::f16_t>(kind);
  }
}

bool invalid_naming(const Status& s, const char* word) {
  return s.code == Status::Code::invalid_argument && s.message.find(word) != std::string::npos;
}

void test_expert_errors() {
  g_case = "expert_errors";
  float x[8] = {};
  int32_t i32[8] = {};
  const int64_t idx[4] = {0, 1, 0, 1};
  PermuteArgs p;
  p.tokens = x, p.permuted = x, p.group_sizes = i32, p.row_map = i32;
  p.num_tokens = 2, p.top_k = 2, p.hidden = 1, p.num_experts = 2;
  p.expert_indices = {idx, IndexType::i64, 3};
  CHECK(invalid_naming(permute(p, ExecContext{}), "expert_indices has 3 entries"));
  p.expert_indices.count = 4;
  CHECK(permute(p, ExecContext{}).ok());
  p.top_k = -1;
  CHECK(invalid_naming(permute(p, ExecContext{}), "k must be non-negative"));
  p.top_k = 2, p.row_map = nullptr;
  CHECK(invalid_naming(permute(p, ExecContext{}), "row_map is null"));
  p.row_map = i32, p.num_tokens = int64_t(1) << 40;
  CHECK(invalid_naming(permute(p, ExecContext{}), "int32"));
  p.num_tokens = 2, p.dtype = DType::f64;
  ExecContext gpu;
  gpu.device = Device::cuda;
  CHECK(invalid_naming(permute(p, gpu), "float64"));
  p.dtype = DType::f32;
  Status s = permute(p, gpu);  // no workspace and no device: a clear status either way
  CHECK(!s.ok() &&
        (s.message.find("CUDA") != std::string::npos || s.message.find("workspace") != std::string::npos));

  UnpermuteArgs u;
  u.permuted = x, u.row_map = i32, u.out = x, u.num_rows = 4, u.num_tokens = 2, u.top_k = 2, u.hidden = 1;
  u.probs = x, u.dtype = DType::bf16, u.probs_dtype = DType::f16;
  CHECK(invalid_naming(unpermute(u, ExecContext{}), "probs must be bfloat16 or float32"));
  u.probs_dtype = DType::f32, u.num_rows = -1;
  CHECK(invalid_naming(unpermute(u, ExecContext{}), "R must be non-negative"));
  UnpermuteBackwardArgs b;  // each output optional: probs without dprobs, dprobs without probs
  b.dout = x, b.permuted = x, b.row_map = i32, b.dpermuted = x, b.probs = x;
  b.num_rows = 4, b.num_tokens = 2, b.top_k = 2, b.hidden = 1;
  CHECK(unpermute_backward(b, ExecContext{}).ok());
  b.dpermuted = nullptr, b.probs = nullptr, b.dprobs = x;
  CHECK(unpermute_backward(b, ExecContext{}).ok());
  b.permuted = nullptr;  // dprobs reads permuted
  CHECK(invalid_naming(unpermute_backward(b, ExecContext{}), "permuted is null"));
  b.permuted = x, b.probs_dtype = DType::f16;
  CHECK(invalid_naming(unpermute_backward(b, ExecContext{}), "probs must be float32, got float16"));
  b.probs_dtype = DType::f32, b.dprobs = nullptr, b.dpermuted = x;
  gpu.workspace = nullptr, gpu.workspace_bytes = 0;
  s = unpermute_backward(b, gpu);  // no workspace and no device: a clear status either way
  CHECK(!s.ok() &&
        (s.message.find("CUDA") != std::string::npos || s.message.find("workspace") != std::string::npos));

  ActivationArgs a;
  a.h = x, a.out = x, a.rows = 2, a.in_features = 3;
  CHECK(invalid_naming(activation(a, ExecContext{}), "swiglu needs an even count"));
  a.kind = static_cast<Activation>(7);
  CHECK(invalid_naming(activation(a, ExecContext{}), "kind must be swiglu, gelu, relu or silu, got 7"));
  a.kind = Activation::gelu, a.out = nullptr;
  CHECK(invalid_naming(activation(a, ExecContext{}), "out is null"));
  ActivationBackwardArgs ab;
  ab.dout = x, ab.h = x, ab.dh = x, ab.rows = 1, ab.in_features = 5;
  CHECK(invalid_naming(activation_backward(ab, ExecContext{}), "swiglu needs an even count"));
  ab.kind = Activation::relu;
  CHECK(activation_backward(ab, ExecContext{}).ok());
}

}  // namespace

// The sm_90a gathered GEMM's arithmetic (gathered_tiles.h): the blocks' persistent walks
// find every tile of every group exactly once, each block's in order, with its group's
// problem; each operand tile's 16-byte pieces cover every element once; a piece's bytes
// stop at the problem's edge.
void test_gathered_tiles() {
  constexpr int kTileM = 128, kTileN = 128;
  std::mt19937 rng(7);
  for (int trial = 0; trial < 60; ++trial) {
    const int groups = trial % 9;  // none, one, several, with empty ones among them
    std::vector<int32_t> problems;
    std::set<std::tuple<int, int, int>> want;
    for (int g = 0; g < groups; ++g) {
      const int m = rng() % 4 == 0 ? 0 : int(rng() % 600), n = rng() % 5 == 0 ? 0 : 1 + int(rng() % 300);
      const int k = int(rng() % 200);
      problems.insert(problems.end(), {m, n, k});
      for (int m0 = 0; m0 < m; m0 += kTileM)
        for (int n0 = 0; n0 < n; n0 += kTileN) want.insert({g, m0, n0});
    }
    for (int blocks : {1, 3, 132}) {
      std::multiset<std::tuple<int, int, int>> got;
      for (int b = 0; b < blocks; ++b) {
        GroupTileWalker<kTileM, kTileN> walker(problems.data(), groups);
        GatheredTile t{};
        std::tuple<int, int, int> previous{-1, 0, 0};
        for (int64_t tile = b; walker.find(tile, t); tile += blocks) {
          CHECK(t.m == problems[3 * t.group] && t.n == problems[3 * t.group + 1] && t.k == problems[3 * t.group + 2]);
          CHECK(t.m0 < t.m && t.n0 < t.n);
          const int k_tiles = t.k_tiles<64>();  // every k covered, no empty k tile
          CHECK(k_tiles * 64 >= t.k && (k_tiles == 0 || (k_tiles - 1) * 64 < t.k));
          CHECK(previous < std::make_tuple(t.group, t.m0, t.n0));
          previous = {t.group, t.m0, t.n0};
          got.insert(previous);
        }
      }
      const std::set<std::tuple<int, int, int>> distinct(got.begin(), got.end());
      CHECK(got.size() == want.size() && distinct == want);
    }
  }

  // A [m, k] or [k, m] and B [k, n] or [n, k], for 2-byte values (8 per piece).
  auto covers_once = [](auto pieces) {
    using Pieces = decltype(pieces);
    const int cols = Pieces::kTileCols;
    std::vector<int> count(size_t(Pieces::kTileRows) * cols, 0);
    for (int thread = 0; thread < Pieces::kLoadThreads; ++thread)
      for (int pass = 0; pass < Pieces::kPasses; ++pass)
        for (int v = 0; v < Pieces::kPieceValues; ++v)
          ++count[size_t(Pieces::row(thread, pass)) * cols + Pieces::col(thread) + v];
    for (int c : count) CHECK(c == 1);
  };
  covers_once(TilePieces<64, 128, 8, 128>{});
  covers_once(TilePieces<128, 64, 8, 128>{});

  // Every operand tile the loads fill, element by element: the operand's value or, past the
  // problem's edge, zero. A is [M, K] or [K, M] in storage, B [N, K] or [K, N]; the storage
  // rows of the gathered dimension (M for A's rows, K for a contraction) are the index
  // array's entries. Each piece is 8 2-byte values, as the kernel's 16-byte copies.
  for (int trial = 0; trial < 40; ++trial) {
    const int m = 1 + int(rng() % 300), n = 1 + int(rng() % 300), k = 1 + int(rng() % 200);
    const GatheredTile t{0, int(rng() % 3) * 128, int(rng() % 3) * 128, m, n, k};
    const int k0 = int(rng() % 4) * 64, sources = 400;
    std::vector<int32_t> indices(400);
    for (int32_t& i : indices) i = int32_t(rng() % sources);
    for (bool is_a : {true, false})
      for (bool rows_along_k : {false, true})
        for (bool gathered : {false, true}) {
          // The operand's value at (i, k): i an m (A) or an n (B); storage row and column of it.
          const int ld = 1000;  // wider than any column
          auto value = [&](int i, int kk) {
            const int along_rows = rows_along_k ? kk : i, along_cols = rows_along_k ? i : kk;
            const int row = gathered ? indices[along_rows] : along_rows;
            return row * ld + along_cols + 1;  // storage[row][col], never 0
          };
          const TileSpans spans = is_a ? a_tile_spans(rows_along_k, t, k0) : b_tile_spans(rows_along_k, t, k0);
          constexpr int kTileRows = 64, kTileCols = 128;  // a tile along K has 64 rows, else 64 columns
          const int rows = rows_along_k ? kTileRows : kTileCols, cols = rows_along_k ? kTileCols : kTileRows;
          std::vector<int> tile(size_t(rows) * cols, -1);
          auto fill = [&](auto pieces) {
            using Pieces = decltype(pieces);
            for (int thread = 0; thread < Pieces::kLoadThreads; ++thread)
              for (int pass = 0; pass < Pieces::kPasses; ++pass) {
                const int r = Pieces::row(thread, pass), c = Pieces::col(thread);
                const int64_t row = storage_row(spans.rows, r, gathered ? indices.data() : nullptr);
                const int values = piece_bytes_at(row, spans.cols, c, 2) / 2;
                for (int v = 0; v < 8; ++v)
                  tile[size_t(r) * cols + c + v] = v < values ? int(row * ld + spans.cols.first + c + v + 1) : 0;
              }
          };
          if (rows_along_k)
            fill(TilePieces<128, 64, 8, 128>{});
          else
            fill(TilePieces<64, 128, 8, 128>{});
          const int first = is_a ? t.m0 : t.n0, extent = is_a ? m : n;
          for (int r = 0; r < rows; ++r)
            for (int c = 0; c < cols; ++c) {
              const int i = first + (rows_along_k ? c : r), kk = k0 + (rows_along_k ? r : c);
              CHECK(tile[size_t(r) * cols + c] == (i < extent && kk < k ? value(i, kk) : 0));
            }
        }
  }

  CHECK(piece_bytes(8, 2) == 16 && piece_bytes(100, 2) == 16 && piece_bytes(3, 2) == 6 && piece_bytes(1, 2) == 2);
  CHECK(piece_bytes(0, 2) == 0 && piece_bytes(-40, 2) == 0 && piece_bytes(3, 4) == 12 && piece_bytes(4, 4) == 16);
}

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
  // GEMM that reads or writes it runs the unaligned kernel; a bias the setup wrote into a
  // float32 output is not the GEMM's operand.
  for (int64_t Shifts::* operand : {&Shifts::lhs, &Shifts::rhs, &Shifts::bias, &Shifts::grad, &Shifts::out}) {
    Shifts shift;
    shift.*operand = 1;
    run_all_dtypes(aligned_shape, cpu, shift);
    run_all_dtypes(aligned_shape, cuda[1], shift);
  }
  check_gemm_paths_seen();
  test_kernel_workspace();
  test_kernel_choice();
  test_gathered_tiles();
  test_sm90_strides();
  test_bf16_wgrad_chunks();
  test_bf16_wgrad_bits_on_any_thread_count();
  test_bf16_widened();
  test_thread_plan();
  test_lru_cache();
  test_onednn_cache_bound();
  test_packed_b_bits();
  cpu::force_bf16_widened(true);
  test_packed_b_bits();
  cpu::force_bf16_widened(std::nullopt);
  test_workspace();
  test_errors();
  test_launch_counts();
  test_permute_steps();
  test_dot_order();
  test_permute_cases();
  test_unpermute_exact();
  test_unpermute_backward_bits_on_any_thread_count();
  test_router_nan_is_masked();
  test_router_out_of_range_index_is_dropped();
  test_activation_derivatives();
  test_expert_errors();
  return report("core_tests");
}
