// Core tests, built under AddressSanitizer + UndefinedBehaviorSanitizer: the schedule
// functions and the CPU backend through the public API, on the edge cases of
// DESIGN.md §2, against a naive double-precision reference.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "groupgemm/groupgemm.h"
#include "groupgemm/schedule.h"

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
  row_boundaries(sizes, IndexType::i32, 6, 10, boundary);
  const int64_t want[] = {0, 3, 3, 7, 7, 10, 10};  // 3+0+4+0+5 > 10: clipped
  CHECK(std::memcmp(boundary, want, sizeof want) == 0);
  w = group_window(2, 2, 6);
  RowRange r = local_group_rows(boundary, w, 2, 0);
  CHECK(r.begin == 3 && r.end == 7);
  r = local_group_rows(boundary, w, 2, 1);
  CHECK(r.rows() == 0);
  r = owned_rows(boundary, w);
  CHECK(r.begin == 3 && r.end == 7);
  CHECK(group_of_row(boundary, group_window(0, 6, 6), 3) == 2);  // skips the empty group 1
  CHECK(group_of_row(boundary, group_window(0, 6, 6), 0) == 0);
  CHECK(group_of_row(boundary, group_window(0, 6, 6), 9) == 4);
  CHECK(group_of_row(boundary, group_window(0, 6, 6), 10) == -1);
  CHECK(group_of_row(boundary, w, 2) == -1);  // outside the window: padding

  const int64_t tile_start[] = {0, 2, 2, 3, 7};  // group 1 is empty
  CHECK(group_of_tile(tile_start, 4, 0) == 0);
  CHECK(group_of_tile(tile_start, 4, 1) == 0);
  CHECK(group_of_tile(tile_start, 4, 2) == 2);
  CHECK(group_of_tile(tile_start, 4, 6) == 3);
  CHECK(group_of_tile(tile_start, 4, 7) == -1);
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

template <typename T>
void run_case(const Case& c, DType dt) {
  g_case = c.name;
  const int64_t G = c.num_local >= 0 ? c.num_local : int64_t(c.sizes.size());
  std::mt19937 rng(42);
  auto lhs = random_vec<T>(c.m * c.k, rng), rhs = random_vec<T>(G * c.k * c.n, rng);
  auto bias = random_vec<T>(G * c.n, rng), dout = random_vec<T>(c.m * c.n, rng);
  const auto rows = ref_rows(c, G);
  IndexArray sizes{c.sizes.data(), IndexType::i64, int64_t(c.sizes.size())};
  IndexArray offset = c.num_local >= 0 ? IndexArray{&c.offset, IndexType::i64, 1} : IndexArray{};
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const ExecContext cpu;

  for (int transpose = 0; transpose < 2; ++transpose) {
    std::vector<T> out(c.m * c.n, nan);  // dirty output memory
    MatmulArgs a;
    a.in_dtype = a.out_dtype = dt;
    a.lhs = lhs.data(), a.rhs = rhs.data(), a.bias = bias.data(), a.out = out.data();
    a.m = c.m, a.k = c.k, a.n = c.n, a.num_groups = G, a.transpose_rhs = transpose;
    a.group_sizes = sizes, a.group_offset = offset;
    CHECK(grouped_matmul(a, cpu).ok());
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
    CHECK(grouped_matmul_wgrad(a, cpu).ok());
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
  CHECK(grouped_bias_grad(b, cpu).ok());
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < c.n; ++j) {
      double want = 0;
      for (int64_t r = rows[g].first; r < rows[g].second; ++r) want += dout[r * c.n + j];
      if (rows[g].second == rows[g].first) CHECK(dbias[g * c.n + j] == T(0));
      else CHECK(close(dbias[g * c.n + j], want));
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
    run_case<double>(c, DType::f64);
    run_case<float>(c, DType::f32);
  }
  test_errors();
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
