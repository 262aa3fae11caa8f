// The CUDA backend's kernels executed on the host, as a launcher for call_sequence.h, so
// the core tests run the GPU's call sequence without a GPU. Each step reads and writes
// the workspace the way its kernel does: the setup kernel's steps with `scan_chunks`
// chunks and a sequential exclusive scan in place of the block scan, and its row and
// group fills; a grouped GEMM over one GEMM set's problems, pointers and leading
// dimensions with float32 accumulation (float64 for float64 operands, which only the host
// runs); the bias gradient in the kernel's summation order. The launcher records what the
// sequence asked for, launches included.
#pragma once

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "call_sequence.h"
#include "convert.h"

namespace groupgemm {
namespace emulated {

// What one call launched, for the tests to check.
struct LaunchRecord {
  int launches = 0;             // every step: setup, GEMMs, bias gradient
  int gemms = 0;                // grouped GEMMs
  bool gemm_aligned = false;    // the last one's kernel: tensor cores (true) or the unaligned one
  GemmC gemm_c = GemmC::none;   // the last one's C
  int64_t zero_k_problems = 0;  // problems with rows and k = 0 that reached a GEMM (must stay 0)
};

// The kernels' arithmetic type for operands of type In.
template <typename In>
using Accumulator = std::conditional_t<std::is_same_v<In, double>, double, float>;

// A value rounded to the storage type Out, as the kernels' Out(float) conversion does.
template <typename Out, typename V>
Out store(V v) {
  if constexpr (std::is_same_v<Out, double>)
    return static_cast<double>(v);
  else
    return cpu::narrow<Out>(static_cast<float>(v));
}

// Calls fn(In{}, Out{}) with the storage types of two dtypes.
template <typename Fn>
void visit_dtypes(DType in, DType out, Fn&& fn) {
  cpu::visit_dtype(in, [&](auto in_tag) {
    return cpu::visit_dtype(out, [&](auto out_tag) {
      fn(in_tag, out_tag);
      return 0;
    });
  });
}

inline WorkspaceView view_of(const void* workspace, int64_t num_groups) {
  return workspace_view(const_cast<void*>(workspace), num_groups);
}

// Host memory for one call's workspace.
class Workspace {
 public:
  explicit Workspace(int64_t num_groups) : storage_((workspace_layout(num_groups).bytes + 7) / 8) {}
  void* data() { return storage_.data(); }

 private:
  std::vector<int64_t> storage_;  // 8-byte aligned; every array's offset is a multiple of 16
};

class HostLauncher {
 public:
  explicit HostLauncher(int64_t scan_chunks) : scan_chunks_(scan_chunks) {}
  const LaunchRecord& record() const { return record_; }

  Status start() { return Status::Ok(); }

  // The setup kernel: the scan (its chunks in thread order), block 0's writes, then the
  // fills of every block, reading the boundaries as the kernel's blocks do.
  Status setup(const SetupArgs& a) {
    ++record_.launches;
    const WorkspaceView ws = workspace_view(a.workspace, a.num_groups);
    const int64_t offset = read_group_offset(a.group_offset);
    const GroupWindow w = group_window(offset, a.num_groups, a.group_sizes.count);
    std::vector<int64_t> boundary(a.num_groups + 1, -1);  // one block's shared copy
    int64_t start = 0;
    for (int64_t t = 0; t < scan_chunks_; ++t) {
      const RowRange chunk = setup_chunk(t, scan_chunks_, w.last);
      write_chunk_boundaries(a, boundary.data(), w, chunk, start);
      start = next_row_boundary(start, chunk_rows(a, chunk), a.m);
    }
    write_empty_window_boundary(boundary.data(), w);
    const WindowRows rows{boundary.data(), w, offset};
    write_header(ws, rows);
    for (int64_t i = 0; i <= w.last - w.first; ++i) ws.boundary[i] = boundary[i];
    for (int64_t local = 0; local < a.num_groups; ++local) write_group_setup(a, ws, rows, local);

    const int64_t row_units = a.rows.out ? a.m : 0;
    for (int64_t unit = 0; unit < fill_units(a); ++unit) {
      if (unit < row_units) {
        fill_row(a.rows, rows, unit);
        continue;
      }
      const GroupFillUnit u = group_fill_unit(a, unit);
      if (group_fill_zeroes(a, rows, u.local))
        std::memset(static_cast<char*>(a.groups.out) + u.local * a.groups.block_bytes + u.begin, 0, u.end - u.begin);
    }
    return Status::Ok();
  }

  // D = A B (+ C) for every problem of the call's GEMM set, reading only the workspace.
  Status grouped_gemm(const GroupedGemmCall& call, bool aligned) {
    ++record_.launches;
    ++record_.gemms;
    record_.gemm_aligned = aligned;
    record_.gemm_c = call.c;
    visit_dtypes(call.in_dtype, call.out_dtype,
                 [&](auto in_tag, auto out_tag) { run_gemms<decltype(in_tag), decltype(out_tag)>(call); });
    return Status::Ok();
  }

  // The bias-gradient kernel's order: lanes over rows, then the lanes in order.
  Status bias_grad(DType in, DType out_dtype, const void* grad, void* out, int64_t n, int64_t num_groups,
                   const void* workspace) {
    ++record_.launches;
    const WindowRows rows = workspace_rows(view_of(workspace, num_groups));
    visit_dtypes(in, out_dtype, [&](auto in_tag, auto out_tag) {
      using In = decltype(in_tag);
      using Out = decltype(out_tag);
      for (int64_t local = 0; local < num_groups; ++local) {
        const RowRange group = rows.group(local);
        for (int64_t j = 0; j < n; ++j) {
          Accumulator<In> partial[kBiasGradLanes];
          for (int lane = 0; lane < kBiasGradLanes; ++lane) {
            partial[lane] = 0;  // an empty group sums to exactly 0
            for (int64_t r = group.begin + lane; r < group.end; r += kBiasGradLanes)
              partial[lane] += cpu::widen(static_cast<const In*>(grad)[r * n + j]);
          }
          Accumulator<In> total = partial[0];
          for (int lane = 1; lane < kBiasGradLanes; ++lane) total += partial[lane];
          static_cast<Out*>(out)[local * n + j] = store<Out>(total);
        }
      }
    });
    return Status::Ok();
  }

 private:
  void fill_row(const RowFill& f, const WindowRows& rows, int64_t r) {
    const RowFillAction action = row_fill_action(f, rows, r);
    if (!action.write) return;
    visit_dtypes(f.bias ? f.bias_dtype : f.out_dtype, f.out_dtype, [&](auto bias_tag, auto out_tag) {
      using Bias = decltype(bias_tag);
      using Out = decltype(out_tag);
      const Bias* bias_row = action.bias_local >= 0 ? static_cast<const Bias*>(f.bias) + action.bias_local * f.n
                                                    : nullptr;
      for (int64_t j = 0; j < f.n; ++j)
        static_cast<Out*>(f.out)[r * f.n + j] = bias_row ? store<Out>(cpu::widen(bias_row[j])) : store<Out>(0.0f);
    });
  }

 private:
  template <typename In, typename Out>
  void run_gemms(const GroupedGemmCall& call) {
    using Acc = Accumulator<In>;
    const GemmArrays ws = view_of(call.workspace, call.num_groups).gemm[call.set];
    const bool a_col = call.layout == GemmLayout::col_row, b_col = call.layout == GemmLayout::row_col;
    for (int64_t g = 0; g < call.num_groups; ++g) {
      const int64_t m = ws.problem[3 * g], n = ws.problem[3 * g + 1], k = ws.problem[3 * g + 2];
      if (m > 0 && k == 0) ++record_.zero_k_problems;
      const In* a = static_cast<const In*>(ws.ptr[0][g]);
      const In* b = static_cast<const In*>(ws.ptr[1][g]);
      const Out* c = static_cast<const Out*>(ws.ptr[2][g]);
      Out* d = static_cast<Out*>(ws.ptr[3][g]);
      const int64_t lda = ws.ld[0][g], ldb = ws.ld[1][g], ldc = ws.ld[2][g], ldd = ws.ld[3][g];
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          Acc acc = 0;
          for (int64_t p = 0; p < k; ++p)
            acc += Acc(cpu::widen(a_col ? a[p * lda + i] : a[i * lda + p])) *
                   Acc(cpu::widen(b_col ? b[j * ldb + p] : b[p * ldb + j]));
          const Acc source = call.c != GemmC::none ? Acc(cpu::widen(c[i * ldc + j])) : Acc(0);
          d[i * ldd + j] = store<Out>(acc + source);
        }
    }
  }

  int64_t scan_chunks_;
  LaunchRecord record_;
};

}  // namespace emulated
}  // namespace groupgemm
