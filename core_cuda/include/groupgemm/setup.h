// The CUDA setup kernel's work, as __host__ __device__ steps. The kernel (cuda/setup.cu)
// runs them with one thread block and a block scan; the CPU tests run the same steps
// with a sequential scan and then execute the resulting workspace on the host, so every
// pointer, leading dimension and policy decision the GPU relies on is checked here.
#pragma once

#include <cstdint>

#include "groupgemm/workspace.h"

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

GG_HD int64_t setup_group_offset(const SetupArgs& a) {
  return a.group_offset.data ? load_index(a.group_offset.data, a.group_offset.type, 0) : 0;
}

GG_HD GroupWindow setup_window(const SetupArgs& a, int64_t group_offset) {
  return group_window(group_offset, a.num_groups, a.group_sizes.count);
}

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
GG_HD void write_chunk_boundaries(const SetupArgs& a, const WorkspaceView& ws, GroupWindow w,
                                  RowRange chunk, int64_t row) {
  for (int64_t g = chunk.begin; g < chunk.end; ++g) {
    if (g == w.first) ws.boundary[0] = row;
    row = next_row_boundary(row, load_index(a.group_sizes.data, a.group_sizes.type, g), a.m);
    if (g >= w.first) ws.boundary[g - w.first + 1] = row;
  }
}

// Written once (thread 0): the window, and boundary[0] when no chunk holds w.first.
GG_HD void write_window(const WorkspaceView& ws, GroupWindow w, int64_t group_offset) {
  ws.window[0] = w.first, ws.window[1] = w.last, ws.window[2] = group_offset, ws.window[3] = 0;
  if (w.first == w.last) ws.boundary[0] = 0;  // no group in the window: every row is padding
}

// After all boundaries are written: local group `local`'s problem, pointers and lds.
GG_HD void write_group_setup(const SetupArgs& a, const WorkspaceView& ws, int64_t local) {
  const GroupWindow w{ws.window[0], ws.window[1]};
  const RowRange rows = local_group_rows(ws.boundary, w, ws.window[2], local);
  const GroupProblem p = a.kind == SetupKind::wgrad ? wgrad_problem(rows, local, a.k, a.n, a.accumulate)
                                                    : forward_problem(rows, local, a.k, a.n, a.transpose_rhs);
  write_group(ws, local, p, a.operands);
}

// For the fill kernels: the local group that owns `row`, or -1 for a padding row.
GG_HD int64_t local_group_of_row(const WorkspaceView& ws, int64_t row) {
  const int64_t g = group_of_row(ws.boundary, GroupWindow{ws.window[0], ws.window[1]}, row);
  return g < 0 ? -1 : g - ws.window[2];
}

// For the fill kernels: rows owned by the window's groups (everything else is padding).
GG_HD RowRange workspace_owned_rows(const WorkspaceView& ws) {
  return owned_rows(ws.boundary, GroupWindow{ws.window[0], ws.window[1]});
}

// For the bias gradient: rows of local group `local`.
GG_HD RowRange workspace_group_rows(const WorkspaceView& ws, int64_t local) {
  return local_group_rows(ws.boundary, GroupWindow{ws.window[0], ws.window[1]}, ws.window[2], local);
}

}  // namespace groupgemm
