// The CPU backend: walks the schedule (groupgemm/schedule.h) on the host and runs one
// library GEMM per non-empty local group. Padding rows and empty groups are written by
// the schedule's policy, never by a GEMM with a zero dimension.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "backends.h"
#include "backward_parts.h"
#include "convert.h"
#include "gemm.h"
#include "groupgemm/problem.h"
#include "huge_pages.h"
#include "row_plan.h"
#include "thread_plan.h"

namespace groupgemm {
namespace cpu {
namespace {

char* at(void* base, int64_t element, DType t) { return static_cast<char*>(base) + element * dtype_size(t); }
const char* at(const void* base, int64_t element, DType t) {
  return static_cast<const char*>(base) + element * dtype_size(t);
}

// memset on all threads: zeroing a freshly allocated gradient is dominated by first-touch
// page faults, which threads take in parallel. Byte-exact, so no effect on results.
void zero_bytes(void* data, int64_t bytes) {
  constexpr int64_t kChunk = int64_t(1) << 20;
  const int64_t chunks = (bytes + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1 && !omp_in_parallel())
  for (int64_t c = 0; c < chunks; ++c)
    std::memset(static_cast<char*>(data) + c * kChunk, 0, std::min(kChunk, bytes - c * kChunk));
}

void zero_rows(void* out, RowRange rows, int64_t n, DType t) {
  if (rows.rows() > 0) zero_bytes(at(out, rows.begin * n, t), rows.rows() * n * dtype_size(t));
}

// The library GEMM of one group's problem (problem.h), on the call's operand base pointers.
GemmCall group_gemm(const GroupProblem& p, DType in, DType out, const void* a, const void* b,
                    const void* bias, void* c, bool accumulate) {
  return {in,
          out,
          p.m,
          p.n,
          p.k,
          at(a, p.a_offset, in),
          p.a_transposed,
          at(b, p.b_offset, in),
          p.b_transposed,
          bias,
          at(c, p.d_offset, out),
          accumulate};
}

double flops(const GemmCall& c) { return static_cast<double>(c.m) * c.n * c.k; }

// Runs the per-group GEMMs of one call (they write disjoint outputs): the largest alone
// on all threads when thread_plan.h says so, the rest side by side, one thread each,
// largest first. Each GEMM is threaded only as gemm_threading allows, so its bits are
// those of a single-threaded run, and so is the result.
Status run_gemms(const std::vector<GemmCall>& calls) {
  if (calls.empty()) return Status::Ok();  // every group empty: nothing to plan or thread
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  std::vector<size_t> may_share, alone;
  for (size_t i = 0; i < calls.size(); ++i)
    (gemm_threading(calls[i]) == Threading::own ? alone : may_share).push_back(i);
  std::stable_sort(may_share.begin(), may_share.end(),
                   [&](size_t a, size_t b) { return flops(calls[a]) > flops(calls[b]); });
  std::vector<double> work;
  for (size_t i : may_share) work.push_back(flops(calls[i]));
  size_t first_shared = gemms_run_alone(work, threads);
  for (size_t i = 0; i < first_shared; ++i)  // a one-thread GEMM and all after it share
    if (gemm_threading(calls[may_share[i]]) == Threading::one) first_shared = i;
  alone.insert(alone.end(), may_share.begin(), may_share.begin() + first_shared);
  for (size_t i : alone) {
    Status s = gemm(calls[i]);
    if (!s.ok()) return s;
  }
  const int64_t count = static_cast<int64_t>(may_share.size() - first_shared);
  std::vector<Status> status(count, Status::Ok());
  // A single GEMM left still runs inside the parallel region: on one thread.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (count > 0)
  for (int64_t i = 0; i < count; ++i) status[i] = gemm(calls[may_share[first_shared + i]]);
  for (const Status& s : status)
    if (!s.ok()) return s;
  return Status::Ok();
}

// float16 has no fast library kernel: widen the operands to float32, run the float32
// path, and round the result once.
std::vector<float> widened(const void* data, int64_t count) {
  std::vector<float> out(data ? count : 0);
  if (data) convert(data, DType::f16, out.data(), DType::f32, count);
  return out;
}

// Where a widened call writes: the caller's buffer when it is float32, otherwise a
// float32 scratch that finish() rounds into the caller's buffer once.
class Float32Output {
 public:
  Float32Output(void* out, DType t, int64_t count)
      : out_(out), t_(t), count_(count), scratch_(t == DType::f32 ? 0 : count) {}
  void* data() { return t_ == DType::f32 ? out_ : scratch_.data(); }
  Status finish(Status s) {
    if (s.ok() && t_ != DType::f32) convert(scratch_.data(), DType::f32, out_, t_, count_);
    return s;
  }

 private:
  void* out_;
  DType t_;
  int64_t count_;
  std::vector<float> scratch_;
};

Status matmul_f16(MatmulArgs a) {
  auto lhs = widened(a.lhs, a.m * a.k);
  auto rhs = widened(a.rhs, a.num_groups * a.k * a.n);
  auto bias = widened(a.bias, a.num_groups * a.n);
  Float32Output out(a.out, a.out_dtype, a.m * a.n);
  a.in_dtype = a.out_dtype = DType::f32;
  a.lhs = lhs.data(), a.rhs = rhs.data(), a.bias = a.bias ? bias.data() : nullptr;
  a.out = out.data();
  return out.finish(grouped_matmul(a));
}

Status wgrad_f16(WgradArgs a) {
  auto lhs = widened(a.lhs, a.m * a.k);
  auto grad = widened(a.grad, a.m * a.n);
  Float32Output out(a.out, a.out_dtype, a.num_groups * a.k * a.n);
  a.in_dtype = a.out_dtype = DType::f32;
  a.lhs = lhs.data(), a.grad = grad.data();
  a.out = out.data();
  return out.finish(grouped_matmul_wgrad(a));
}

}  // namespace

Status grouped_matmul(const MatmulArgs& a) {
  if (a.in_dtype == DType::f16) return matmul_f16(a);
  const RowPlan plan(a.group_sizes, a.group_offset, a.num_groups, a.m);
  advise_huge_pages(a.out, a.m * a.n * dtype_size(a.out_dtype));
  const RowRange owned = plan.owned();
  zero_rows(a.out, {0, owned.begin}, a.n, a.out_dtype);
  zero_rows(a.out, {owned.end, a.m}, a.n, a.out_dtype);
  if (a.n == 0) return Status::Ok();

  std::vector<GemmCall> gemms;
  for (int64_t g = 0; g < a.num_groups; ++g) {
    const RowRange rows = plan.group(g);
    const GroupProblem p = forward_problem(rows, g, a.k, a.n, a.transpose_rhs);
    const void* bias = a.bias ? at(a.bias, p.c_offset, a.in_dtype) : nullptr;
    switch (p.action) {
      case GroupAction::gemm:
        gemms.push_back(group_gemm(p, a.in_dtype, a.out_dtype, a.lhs, a.rhs, bias, a.out, false));
        break;
      case GroupAction::write_zero:  // K == 0: the product is empty, only the bias remains
        zero_rows(a.out, rows, a.n, a.out_dtype);
        if (bias)
          for (int64_t r = rows.begin; r < rows.end; ++r)
            convert(bias, a.in_dtype, at(a.out, r * a.n, a.out_dtype), a.out_dtype, a.n);
        break;
      case GroupAction::leave_untouched: break;
    }
  }
  return run_gemms(gemms);
}

Status grouped_matmul_wgrad(const WgradArgs& a) {
  if (a.in_dtype == DType::f16) return wgrad_f16(a);
  const RowPlan plan(a.group_sizes, a.group_offset, a.num_groups, a.m);
  const int64_t block = a.k * a.n;
  if (block == 0) return Status::Ok();
  advise_huge_pages(a.out, a.num_groups * block * dtype_size(a.out_dtype));

  std::vector<GemmCall> gemms;
  for (int64_t g = 0; g < a.num_groups; ++g) {
    const GroupProblem p = wgrad_problem(plan.group(g), g, a.k, a.n, a.accumulate);
    void* out = at(a.out, p.d_offset, a.out_dtype);
    switch (p.action) {
      case GroupAction::gemm:
        gemms.push_back(group_gemm(p, a.in_dtype, a.out_dtype, a.lhs, a.grad, nullptr, a.out, a.accumulate));
        break;
      case GroupAction::write_zero: zero_bytes(out, block * dtype_size(a.out_dtype)); break;
      case GroupAction::leave_untouched: break;
    }
  }
  return run_gemms(gemms);
}

Status grouped_bias_grad(const BiasGradArgs& a) {
  const RowPlan plan(a.group_sizes, a.group_offset, a.num_groups, a.m);
  return visit_dtype(a.in_dtype, [&](auto in_tag) {
    using In = decltype(in_tag);
    using Acc = std::conditional_t<std::is_same_v<In, double>, double, float>;
    std::vector<Acc> acc(a.n);
    const In* grad = static_cast<const In*>(a.grad);
    for (int64_t g = 0; g < a.num_groups; ++g) {
      const RowRange rows = plan.group(g);
      std::fill(acc.begin(), acc.end(), Acc(0));
      if (reduction_action(rows.rows(), false) == GroupAction::gemm)
        for (int64_t r = rows.begin; r < rows.end; ++r)  // fixed row order: deterministic
          for (int64_t j = 0; j < a.n; ++j) acc[j] += widen(grad[r * a.n + j]);
      convert(acc.data(), std::is_same_v<Acc, double> ? DType::f64 : DType::f32,
              at(a.out, g * a.n, a.out_dtype), a.out_dtype, a.n);
    }
    return Status::Ok();
  });
}

// The three separate calls (backward_parts.h), so the bits are theirs.
Status grouped_matmul_backward(const BackwardArgs& a) {
  if (a.dlhs) GG_RETURN_IF_ERROR(grouped_matmul(dgrad_part(a)));
  if (a.drhs) GG_RETURN_IF_ERROR(grouped_matmul_wgrad(wgrad_part(a)));
  if (a.dbias) GG_RETURN_IF_ERROR(grouped_bias_grad(bias_grad_part(a)));
  return Status::Ok();
}

}  // namespace cpu
}  // namespace groupgemm
