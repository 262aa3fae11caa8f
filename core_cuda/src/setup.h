// The CUDA setup kernel's work, and the per-row rules of the fill kernels, as
// __host__ __device__ steps. The kernels (cuda/setup.cu, cuda/fill.cu) run them on the
// device; the CPU tests run the same steps with a sequential scan and execute the
// resulting workspace on the host, which checks the problem sizes, pointers, leading
// dimensions and empty-group policy the GPU kernels rely on.
#pragma once

#include <cstdint>

#include "workspace.h"

namespace groupgemm {

enum class SetupKind : int { forward = 0, wgrad = 1, rows_only = 2 };

struct SetupArgs {
  SetupKind kind;
  IndexArray group_sizes;
  IndexArray group_offset;
  int64_t num_groups, m, k, n;
  bool transpose_rhs;  // forward
  bool accumulate;     // wgrad
  GemmOperands operands;
  void* workspace;
};

// Thread `t` of `threads` folds the contiguous chunk [begin, end) of groups [0, w.last).
GG_HD RowRange setup_chunk(int64_t t, int64_t threads, GroupWindow w) {
  const int64_t chunk = ceil_div(w.last, threads);
  const int64_t begin = t * chunk < w.last ? t * chunk : w.last;
  return {begin, begin + chunk < w.last ? begin + chunk : w.last};
}

// Rows of the chunk's groups: what the block scan combines with the saturating sum
// next_row_boundary(a, b, m) = min(a + b, m) (associative on [0, m], identity 0).
GG_HD int64_t chunk_rows(const SetupArgs& a, RowRange chunk) {
  return fold_row_boundary(a.group_sizes.data, a.group_sizes.type, chunk.begin, chunk.end, 0, a.m);
}

// Given the row where the chunk starts (the scan's result), writes the window's
// boundaries that fall in the chunk.
GG_HD void write_chunk_boundaries(const SetupArgs& a, const WorkspaceView& ws, GroupWindow w, RowRange chunk,
                                  int64_t row) {
  for (int64_t g = chunk.begin; g < chunk.end; ++g) {
    if (g == w.first) ws.boundary[0] = row;
    row = next_row_boundary(row, load_index(a.group_sizes.data, a.group_sizes.type, g), a.m);
    if (g >= w.first) ws.boundary[g - w.first + 1] = row;
  }
}

// Written once (thread 0): the window, and boundary[0] when no chunk holds w.first.
GG_HD void write_window(const WorkspaceView& ws, GroupWindow w, int64_t group_offset) {
  *ws.window = WindowHeader{w, group_offset, 0};
  if (w.first == w.last) ws.boundary[0] = 0;  // no group in the window: every row is padding
}

// Rows of local group `local`, from the written boundaries.
GG_HD RowRange workspace_group_rows(const WorkspaceView& ws, int64_t local) {
  return local_group_rows(ws.boundary, ws.window->window, ws.window->group_offset, local);
}

// After all boundaries are written: local group `local`'s problem, pointers and lds.
GG_HD void write_group_setup(const SetupArgs& a, const WorkspaceView& ws, int64_t local) {
  const RowRange rows = workspace_group_rows(ws, local);
  const GroupProblem p = a.kind == SetupKind::wgrad ? wgrad_problem(rows, local, a.k, a.n, a.accumulate)
                                                    : forward_problem(rows, local, a.k, a.n, a.transpose_rhs);
  write_group(ws, local, p, a.operands);
}

// What the forward fill kernel writes into output row `row`, which no GEMM writes when
// it is padding (zeros) or when K = 0 (its group's bias row, or zeros).
struct RowFill {
  bool write;     // false: a GEMM writes this row
  int64_t local;  // local group whose bias row to copy, or -1 for zeros
};

GG_HD RowFill forward_row_fill(const WorkspaceView& ws, int64_t row, bool k_is_zero, bool has_bias) {
  const RowRange owned = owned_rows(ws.boundary, ws.window->window);
  if (row < owned.begin || row >= owned.end) return {true, -1};
  if (!k_is_zero) return {false, -1};
  const int64_t g = group_of_row(ws.boundary, ws.window->window, row);  // owned: g >= 0
  return {true, has_bias ? g - ws.window->group_offset : -1};
}

// For the float32 late-bias kernel: the local group that owns `row`, or -1 for padding.
GG_HD int64_t local_group_of_row(const WorkspaceView& ws, int64_t row) {
  const int64_t g = group_of_row(ws.boundary, ws.window->window, row);
  return g < 0 ? -1 : g - ws.window->group_offset;
}

}  // namespace groupgemm
