// The CUDA backend's FP8 call sequences (src/fp8_call_sequence.h) run on the host, against
// the CPU backend, built under AddressSanitizer + UndefinedBehaviorSanitizer like
// core_tests. A host launcher runs each step the way its kernel does: the 16-bit GEMMs'
// setup kernel (its row fill and group fill included) and the token-block scan over 1, 3
// and 256 scan chunks, the scale re-layout, the 128-token alignment of the weight
// gradient's operands and the grouped GEMM over the workspace's problems, pointers,
// leading dimensions and kernel-layout scales ([K/128][M_g] and [K/128][N] per group, one
// scale per row of A and of B, as the sm_90a kernel reads them), accumulating every 128 of
// K as it does. Its results must equal the CPU backend's on the edge cases of the semantics
// (empty groups, all empty, sum < M and > M, windows, groups longer than a block, K = 0,
// N = 0), both recipes, both lhs formats, both outputs, bias and accumulation, with the
// groups given as sizes and as cumulative ends, in the launches the sequence promises; the
// grouped quantization must give the CPU's bits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "convert.h"
#include "fp8_backends.h"
#include "fp8_call_sequence.h"
#include "groupgemm/fp8.h"
#include "groupgemm/fp8_math.h"
#include "host_launcher.h"

using namespace groupgemm;
using namespace groupgemm_tests;

namespace {

// Host memory for one call's workspace (8-byte aligned; every array is 16-byte aligned
// relative to it, which is all the host steps need).
struct HostWorkspace {
  explicit HostWorkspace(const Fp8WorkspaceLayout& l) : storage((l.bytes + 7) / 8 + 1) {}
  void* data() { return storage.data(); }
  std::vector<int64_t> storage;
};

float load_out(const void* d, DType t, int64_t i) {
  return t == DType::f32 ? static_cast<const float*>(d)[i]
                         : cpu::widen(static_cast<const cpu::bf16_t*>(d)[i]);
}

void store_out(void* d, DType t, int64_t i, float v) {
  if (t == DType::f32)
    static_cast<float*>(d)[i] = v;
  else
    static_cast<cpu::bf16_t*>(d)[i] = cpu::narrow<cpu::bf16_t>(v);
}

// fp8_call_sequence.h's steps on the host; the 16-bit GEMMs' setup is core_tests' host
// run of that kernel (host_launcher.h), its scan in `chunks` chunks.
class HostFp8Launcher {
 public:
  HostFp8Launcher(int64_t chunks, DType out_dtype) : chunks_(chunks), setup_(chunks), out_dtype_(out_dtype) {}
  int launches = 0, gemms = 0;

  Status start() { return Status::Ok(); }
  Status require_fp8_tensor_cores() { return Status::Ok(); }

  Status setup(const SetupArgs& a) {
    ++launches;
    return setup_.setup(a);
  }

  // The token-block kernel: its block scan sequentially, in thread order.
  Status token_blocks(const Fp8SetupArgs& a) {
    ++launches;
    const Fp8WorkspaceView ws = fp8_view(a);
    const WindowRows rows = workspace_rows(ws.base);
    int64_t first = 0;
    for (int64_t t = 0; t < chunks_; ++t) {
      const RowRange chunk = setup_chunk(t, chunks_, a.num_groups);
      write_first_blocks(ws.first_block, rows, chunk, first);
      first += chunk_token_blocks(rows, chunk);
    }
    ws.first_block[a.num_groups] = first;
    if (a.kind == Fp8SetupKind::wgrad)
      for (int64_t g = 0; g < a.num_groups; ++g) write_wgrad_group(a, ws, g);
    return Status::Ok();
  }

  Status relayout_scales(const Fp8SetupArgs& a) {
    ++launches;
    const Fp8WorkspaceView ws = fp8_view(a);
    const WindowRows rows = workspace_rows(ws.base);
    const int64_t kb_count = fp8_blocks(a.k);
    for (int64_t g = 0; g < a.num_groups; ++g) write_scale_pointers(a, ws, g);
    for (int64_t row = 0; row < a.m; ++row)
      for (int64_t kb = 0; kb < kb_count; ++kb) {
        const int64_t slot = lhs_scale_slot(rows, row, kb, kb_count);
        if (slot >= 0) ws.scale_a[slot] = a.operands.a_scale[lhs_scale_index(a.scaling, row, kb, kb_count)];
      }
    for (int64_t i = 0; i < a.num_groups * kb_count * a.n; ++i)
      ws.scale_b[i] = a.operands.b_scale[rhs_scale_index(a.scaling, i / (a.n * kb_count), i % a.n, a.n,
                                                         i / a.n % kb_count, kb_count)];
    return Status::Ok();
  }

  Status align_tokens(const Fp8SetupArgs& a) {
    ++launches;
    const Fp8WorkspaceView ws = fp8_view(a);
    const WindowRows rows = workspace_rows(ws.base);
    const int64_t tokens = a.layout.aligned_tokens, blocks = ws.first_block[a.num_groups];
    const auto* lhs = static_cast<const uint8_t*>(a.operands.a);
    const auto* rhs = static_cast<const uint8_t*>(a.operands.b);
    for (int64_t col = 0; col < blocks * kFp8Block; ++col) {
      const int64_t src = aligned_source_token(rows, ws.first_block, a.num_groups, col);
      for (int64_t c = 0; c < a.k; ++c) ws.operand_a[c * tokens + col] = src >= 0 ? lhs[c * a.m + src] : 0;
      for (int64_t c = 0; c < a.n; ++c) ws.operand_b[c * tokens + col] = src >= 0 ? rhs[c * a.m + src] : 0;
    }
    if (a.scaling == Fp8Scaling::rowwise)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t g = group_of_block(ws.first_block, a.num_groups, b);
        for (int64_t c = 0; c < a.k; ++c) ws.scale_a[b * a.k + c] = a.operands.a_scale[g * a.k + c];
        for (int64_t c = 0; c < a.n; ++c) ws.scale_b[b * a.n + c] = a.operands.b_scale[g * a.n + c];
      }
    return Status::Ok();
  }

  // The sm_90a kernel's arithmetic: per 128-block of K a float32 partial sum, scaled by its
  // row's and column's scales into a float32 accumulator; D = acc + beta * C (C is D).
  Status grouped_gemm(const Fp8SetupArgs& a, Fp8Type lhs_type, float beta) {
    ++launches;
    ++gemms;
    const Fp8WorkspaceView ws = fp8_view(a);
    const GemmArrays& set = ws.base.gemm[kFp8GemmSet];
    float a_values[256], b_values[256];  // the float8 bit patterns decoded
    for (int v = 0; v < 256; ++v)
      a_values[v] = fp8_to_float(uint8_t(v), lhs_type), b_values[v] = fp8_to_float(uint8_t(v), Fp8Type::e4m3);
    for (int64_t g = 0; g < a.num_groups; ++g) {
      const int64_t m = set.problem[3 * g], n = set.problem[3 * g + 1], k = set.problem[3 * g + 2];
      if (m == 0 || n == 0 || k == 0) {
        CHECK(m == 0 && n == 0 && k == 0);  // no k = 0 problem with rows reaches the kernel
        continue;
      }
      const auto* A = static_cast<const uint8_t*>(set.ptr[0][g]);
      const auto* B = static_cast<const uint8_t*>(set.ptr[1][g]);
      const float* sfa = ws.scale_ptr[0][g];
      const float* sfb = ws.scale_ptr[1][g];
      void* D = set.ptr[3][g];
      CHECK(set.ptr[2][g] == D && set.ld[2][g] == set.ld[3][g]);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          float acc = 0.0f;
          for (int64_t kb = 0; kb < fp8_blocks(k); ++kb) {
            float partial = 0.0f;
            for (int64_t kk = kb * kFp8Block; kk < std::min(k, (kb + 1) * kFp8Block); ++kk)
              partial += a_values[A[i * set.ld[0][g] + kk]] * b_values[B[j * set.ld[1][g] + kk]];
            acc = std::fma(partial, sfa[kb * m + i] * sfb[kb * n + j], acc);
          }
          const int64_t at = i * set.ld[3][g] + j;
          const int64_t base =
              (static_cast<char*>(D) - static_cast<char*>(a.operands.d)) / dtype_size(out_dtype_);
          store_out(a.operands.d, out_dtype_, base + at,
                    beta != 0.0f ? acc + load_out(a.operands.d, out_dtype_, base + at) : acc);
        }
    }
    return Status::Ok();
  }

  Status quantize_grouped(const QuantizeGroupedArgs& a, const Fp8SetupArgs& s) {
    ++launches;
    const Fp8WorkspaceView ws = fp8_view(s);
    const WindowRows rows = workspace_rows(ws.base);
    const RowRange owned = rows.owned();
    auto* q = static_cast<uint8_t*>(a.q);
    const auto* x = static_cast<const float*>(a.x);  // the tests quantize float32
    for (int64_t c = 0; c < a.cols; ++c)
      for (int64_t r = 0; r < a.m; ++r)
        if (r < owned.begin || r >= owned.end) q[c * a.m + r] = 0;
    for (int64_t sr = 0; sr < token_scale_rows(a.scaling, a.m, a.num_groups); ++sr) {
      const RowRange tokens = scale_row_tokens(rows, ws.first_block, a.scaling, a.num_groups, sr);
      for (int64_t c = 0; c < a.cols; ++c) {
        float amax = 0.0f;
        for (int64_t r = tokens.begin; r < tokens.end; ++r) amax = amax_step(amax, x[r * a.cols + c]);
        const float scale = fp8_scale(amax, a.out_type, a.power_of_two);
        a.scale[sr * a.cols + c] = scale;
        for (int64_t r = tokens.begin; r < tokens.end; ++r)
          q[c * a.m + r] = quantize_value(x[r * a.cols + c], scale, a.out_type);
      }
    }
    return Status::Ok();
  }

 private:
  int64_t chunks_;
  emulated::HostLauncher setup_;
  DType out_dtype_;
};

struct Case {
  const char* name;
  int64_t m;
  std::vector<int32_t> sizes;
  int64_t num_groups;    // local groups
  int64_t offset = -99;  // -99: no group_offset
};

std::vector<Case> cases() {
  return {{"uniform", 24, {6, 6, 6, 6}, 4},
          {"empty_groups", 24, {20, 0, 0, 3}, 4},
          {"all_empty", 16, {0, 0, 0}, 3},
          {"no_rows", 0, {0, 0}, 2},
          {"sum_below_rows", 30, {5, 5, 5}, 3},
          {"sum_above_rows", 10, {4, 4, 4, 4}, 4},
          {"negative_size", 12, {5, -3, 4, 2}, 4},
          {"long_groups", 200, {130, 0, 5, 65}, 4},
          {"window_middle", 15, {3, 0, 4, 2, 5, 1}, 2, 2},
          {"window_past_end", 15, {3, 0, 4, 2, 5, 1}, 2, 5},
          {"window_before_start", 15, {3, 0, 4, 2, 5, 1}, 2, -1},
          {"window_outside", 15, {3, 0, 4, 2, 5, 1}, 2, 9},
          {"no_groups", 6, {}, 0}};
}

std::vector<float> random_values(int64_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> v(count);
  for (float& x : v) x = normal(rng) * std::exp(normal(rng));
  return v;
}

ExecContext cpu_context() { return {}; }

struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> scale;
};

Quantized quantize_cpu_rows(const std::vector<float>& x, int64_t rows, int64_t cols, Fp8Type t,
                            Fp8Scaling s) {
  Quantized out{std::vector<uint8_t>(rows * cols),
                std::vector<float>(s == Fp8Scaling::rowwise ? rows : rows * fp8_blocks(cols))};
  QuantizeRowsArgs a;
  a.out_type = t, a.scaling = s, a.x = x.data(), a.q = out.q.data(), a.scale = out.scale.data(),
  a.rows = rows, a.cols = cols;
  CHECK(quantize_rows(a, cpu_context()).ok());
  return out;
}

// A weight [G, N, K] quantized as each recipe's rhs.
Quantized quantize_cpu_weight(const std::vector<float>& w, int64_t g, int64_t n, int64_t k, Fp8Scaling s) {
  if (s == Fp8Scaling::rowwise) return quantize_cpu_rows(w, g * n, k, Fp8Type::e4m3, s);
  Quantized out{std::vector<uint8_t>(g * n * k), std::vector<float>(g * fp8_blocks(n) * fp8_blocks(k))};
  QuantizeBlocksArgs a;
  a.x = w.data(), a.q = out.q.data(), a.scale = out.scale.data(), a.batch = g, a.rows = n, a.cols = k;
  CHECK(quantize_blocks(a, cpu_context()).ok());
  return out;
}

IndexArray sizes_of(const Case& c) {
  return {c.sizes.data(), IndexType::i32, static_cast<int64_t>(c.sizes.size())};
}

// The case's groups as torch's offs: cumulative ends, which the core reads as the same
// sizes (a negative size is a decrease, counted as 0 as the size itself is).
struct Ends {
  explicit Ends(const Case& c) {
    int32_t end = 0;
    for (int32_t size : c.sizes) values.push_back(end += size);
  }
  IndexArray array() const {
    return {values.data(), IndexType::i32, static_cast<int64_t>(values.size()), true};
  }
  std::vector<int32_t> values;
};

// The setup's scans in 1, 3 and 256 chunks, as a GPU block would split them.
constexpr int64_t kScanChunks[] = {1, 3, 256};

void test_matmul(const Case& c, Fp8Scaling scaling, Fp8Type lhs_type, DType out_dtype, bool bias, int64_t k) {
  const int64_t n = 48, g = c.num_groups;
  std::mt19937 rng(7);
  const Quantized lhs = quantize_cpu_rows(random_values(c.m * k, rng), c.m, k, lhs_type, scaling);
  const Quantized rhs = quantize_cpu_weight(random_values(g * n * k, rng), g, n, k, scaling);
  std::vector<float> bias_values = random_values(g * n, rng);
  std::vector<uint8_t> bias_bytes(g * n * dtype_size(out_dtype));
  for (int64_t i = 0; i < g * n; ++i) store_out(bias_bytes.data(), out_dtype, i, bias_values[i]);
  const int32_t offset32 = static_cast<int32_t>(c.offset);
  ScaledMatmulArgs a;
  a.lhs_type = lhs_type, a.scaling = scaling, a.out_dtype = out_dtype;
  a.lhs = lhs.q.data(), a.rhs = rhs.q.data(), a.lhs_scale = lhs.scale.data(), a.rhs_scale = rhs.scale.data();
  a.bias = bias ? bias_bytes.data() : nullptr;
  a.m = c.m, a.k = k, a.n = n, a.num_groups = g, a.group_sizes = sizes_of(c);
  if (c.offset != -99) a.group_offset = {&offset32, IndexType::i32, 1};
  std::vector<uint8_t> want(c.m * n * dtype_size(out_dtype), 0xff), got(want.size(), 0xff);  // NaN-filled
  a.out = want.data();
  CHECK(scaled_grouped_matmul(a, cpu_context()).ok());
  const Fp8WorkspaceLayout layout = fp8_workspace_layout(Fp8Call::matmul, scaling, g, c.m, k, n, 0);
  const Ends ends(c);
  for (const IndexArray& groups : {sizes_of(c), ends.array()})
    for (int64_t chunks : kScanChunks) {
      HostWorkspace ws(layout);
      HostFp8Launcher launch(chunks, out_dtype);
      std::fill(got.begin(), got.end(), uint8_t(0xff));
      a.out = got.data(), a.group_sizes = groups;
      CHECK(enqueue_scaled_matmul(a, ws.data(), layout, launch).ok());
      const bool gemm = c.m > 0 && k > 0 && g > 0;
      CHECK(launch.gemms == (gemm ? 1 : 0) && launch.launches == (gemm ? 3 : c.m > 0 ? 1 : 0));
      bool equal = true;
      for (int64_t i = 0; i < c.m * n; ++i)
        equal = equal && load_out(got.data(), out_dtype, i) == load_out(want.data(), out_dtype, i);
      CHECK(equal);
    }
}

void test_wgrad(const Case& c, Fp8Scaling scaling, Fp8Type lhs_type, DType out_dtype, bool accumulate) {
  const int64_t k = 48, n = 32, g = c.num_groups;
  std::mt19937 rng(11);
  const std::vector<float> dout = random_values(c.m * k, rng), x = random_values(c.m * n, rng);
  const int32_t offset32 = static_cast<int32_t>(c.offset);
  const IndexArray offset = c.offset != -99 ? IndexArray{&offset32, IndexType::i32, 1} : IndexArray{};
  const int64_t scale_rows = token_scale_rows(scaling, c.m, g);
  // The grouped quantization: the host-run CUDA sequence gives the CPU's bits.
  Quantized q[2];
  for (int i = 0; i < 2; ++i) {
    const std::vector<float>& values = i == 0 ? dout : x;
    const int64_t cols = i == 0 ? k : n;
    QuantizeGroupedArgs qa;
    qa.out_type = i == 0 ? lhs_type : Fp8Type::e4m3, qa.scaling = scaling, qa.x = values.data();
    qa.m = c.m, qa.cols = cols, qa.num_groups = g, qa.group_sizes = sizes_of(c), qa.group_offset = offset;
    q[i] = {std::vector<uint8_t>(c.m * cols, 0x55), std::vector<float>(scale_rows * cols, -1.0f)};
    qa.q = q[i].q.data(), qa.scale = q[i].scale.data();
    CHECK(quantize_grouped(qa, cpu_context()).ok());
    const Fp8WorkspaceLayout layout =
        fp8_workspace_layout(Fp8Call::quantize_grouped, scaling, g, c.m, 0, 0, 0);
    for (int64_t chunks : kScanChunks) {
      Quantized emulated{std::vector<uint8_t>(c.m * cols, 0x55),
                         std::vector<float>(scale_rows * cols, -1.0f)};
      qa.q = emulated.q.data(), qa.scale = emulated.scale.data();
      HostWorkspace ws(layout);
      HostFp8Launcher launch(chunks, out_dtype);
      CHECK(enqueue_quantize_grouped(qa, ws.data(), layout, launch).ok());
      CHECK(emulated.q == q[i].q);
      CHECK(emulated.scale.empty() ||
            std::memcmp(emulated.scale.data(), q[i].scale.data(), emulated.scale.size() * 4) == 0);
    }
  }
  ScaledWgradArgs a;
  a.lhs_type = lhs_type, a.scaling = scaling, a.out_dtype = out_dtype, a.accumulate = accumulate;
  a.lhs = q[0].q.data(), a.rhs = q[1].q.data(), a.lhs_scale = q[0].scale.data(),
  a.rhs_scale = q[1].scale.data();
  a.m = c.m, a.k = k, a.n = n, a.num_groups = g, a.group_sizes = sizes_of(c), a.group_offset = offset;
  std::vector<float> start = random_values(g * k * n, rng);
  std::vector<uint8_t> want(g * k * n * dtype_size(out_dtype), 0xff);
  if (accumulate && !want.empty()) std::memcpy(want.data(), start.data(), want.size());
  std::vector<uint8_t> got = want;
  a.out = want.data();
  CHECK(scaled_grouped_matmul_wgrad(a, cpu_context()).ok());
  const Fp8WorkspaceLayout layout = fp8_workspace_layout(Fp8Call::wgrad, scaling, g, c.m, k, n, 0);
  const std::vector<uint8_t> before = got;
  const Ends ends(c);
  for (const IndexArray& groups : {sizes_of(c), ends.array()})
    for (int64_t chunks : kScanChunks) {
      HostWorkspace ws(layout);
      HostFp8Launcher launch(chunks, out_dtype);
      got = before;
      a.out = got.data(), a.group_sizes = groups;
      CHECK(enqueue_scaled_wgrad(a, ws.data(), layout, launch).ok());
      CHECK(launch.launches == (g == 0 ? 0 : c.m == 0 ? 1 : 4) && launch.gemms == (g > 0 && c.m > 0 ? 1 : 0));
      bool equal = true;
      for (int64_t i = 0; i < g * k * n; ++i)
        equal = equal && load_out(got.data(), out_dtype, i) == load_out(want.data(), out_dtype, i);
      CHECK(equal);
    }
}

void test_workspace_layout() {
  g_case = "workspace layout";
  const Fp8WorkspaceLayout l =
      fp8_workspace_layout(Fp8Call::wgrad, Fp8Scaling::rowwise, 5, 300, 48, 32, 1000);
  CHECK(l.aligned_tokens == 128 * token_block_bound(300, 5));
  CHECK(l.first_block == l.base.bytes);  // after the 16-bit GEMMs' workspace
  CHECK(l.operand_a % 16 == 0 && l.operand_b % 16 == 0 && l.kernel % 16 == 0 && l.bytes > l.kernel + 1000);
  CHECK(l.operand_b - l.operand_a >= 48 * l.aligned_tokens);
  const Fp8WorkspaceLayout q =
      fp8_workspace_layout(Fp8Call::quantize_grouped, Fp8Scaling::blockwise, 5, 300, 0, 0, 0);
  CHECK(q.bytes == q.operand_a && q.scale_ptr[1] == q.scale_a);  // no GEMM arrays
  CHECK(token_block_bound(1, 1) == 1 && token_block_bound(128, 1) == 1 && token_block_bound(129, 1) == 2);
  CHECK(token_block_bound(0, 4) == 0 && token_block_bound(389, 4) == 7);
}

}  // namespace

int main() {
  test_workspace_layout();
  for (const Case& c : cases())
    for (Fp8Scaling scaling : {Fp8Scaling::rowwise, Fp8Scaling::blockwise})
      for (auto [lhs, out] : {std::pair{Fp8Type::e4m3, DType::bf16}, {Fp8Type::e5m2, DType::f32}}) {
        g_case = std::string(c.name) + (scaling == Fp8Scaling::rowwise ? "/rowwise/" : "/blockwise/") +
                 fp8_name(lhs) + "/" + dtype_name(out);
        test_matmul(c, scaling, lhs, out, out == DType::f32, 256);
        test_matmul(c, scaling, lhs, out, false, 0);
        test_wgrad(c, scaling, lhs, out, false);
        if (out == DType::f32) test_wgrad(c, scaling, lhs, out, true);
      }
  return report("fp8_tests");
}
