// The CUDA setup kernel's work as __host__ __device__ steps: from the device-resident
// group sizes, the window's row boundaries (a block scan), each local group's GEMM
// problems for up to two grouped GEMMs, and the output rows and blocks that no GEMM
// writes (padding rows, K = 0 rows, bias rows a float32 output accumulates onto, empty
// groups' weight gradients). The kernel (cuda/setup.cu) runs them on the device, every
// block with its own copy of the boundaries, so one launch both sets up and fills; the
// CPU tests run the same steps with a sequential scan and execute the resulting workspace
// on the host, which checks the problem sizes, pointers, leading dimensions, fills and
// empty-group policy the GPU kernels rely on.
#pragma once

#include <cstdint>

#include "workspace.h"

namespace groupgemm {

enum class SetupKind : int { forward = 0, wgrad = 1 };

// One grouped GEMM the setup describes: a forward / dgrad problem or a weight-gradient
// problem for every local group, written into the workspace's GEMM set of its index.
struct GemmSetup {
  SetupKind kind;
  int64_t k, n;
  bool transpose_rhs;  // forward: rhs[g] stored [N, K]
  bool c_is_output;    // forward: C is the output, whose rows the setup fills with the bias
  bool accumulate;     // wgrad: add into the output; empty groups leave it untouched
  GemmOperands operands;
};

// The [m, n] output whose rows the setup writes when no GEMM does: padding rows become 0;
// with owned_rows, every owned row becomes its group's bias row, or 0 without bias (K = 0,
// or a float32 output whose GEMM then adds onto it). out null: nothing to fill.
struct RowFill {
  void* out = nullptr;
  DType out_dtype = DType::f32;
  int64_t out_bytes = 4;  // per element
  int64_t n = 0;
  const void* bias = nullptr;  // [G, n] in bias_dtype, or null
  DType bias_dtype = DType::f32;
  bool owned_rows = false;
};

// The output of G blocks of block_bytes each whose blocks the setup zeroes (all-zero
// bytes: the zero of every float dtype) for every local group that GEMM set `set` gives
// the write_zero action (a weight gradient's empty groups). out null: nothing to fill.
struct GroupFill {
  void* out = nullptr;
  int64_t block_bytes = 0;
  int set = 0;
};

struct SetupArgs {
  IndexArray group_sizes;
  IndexArray group_offset;
  int64_t num_groups, m;
  int num_gemms;  // GEMM sets to write, 0 to kGemmSets
  GemmSetup gemm[kGemmSets];
  RowFill rows;
  GroupFill groups;
  void* workspace;
};

// Thread `t` of `threads` takes the contiguous chunk [begin, end) of [0, count): for the
// row scan, count is w.last (it folds groups [0, w.last)).
GG_HD RowRange setup_chunk(int64_t t, int64_t threads, int64_t count) {
  const int64_t chunk = ceil_div(count, threads);
  const int64_t begin = t * chunk < count ? t * chunk : count;
  return {begin, begin + chunk < count ? begin + chunk : count};
}

// Rows of the chunk's groups: what the block scan combines with the saturating sum
// next_row_boundary(a, b, m) = min(a + b, m) (associative on [0, m], identity 0).
GG_HD int64_t chunk_rows(const SetupArgs& a, RowRange chunk) {
  return fold_row_boundary(a.group_sizes, chunk.begin, chunk.end, 0, a.m);
}

// Given the row where the chunk starts (the scan's result), writes the window's
// boundaries that fall in the chunk into `boundary` (w.last - w.first + 1 entries).
GG_HD void write_chunk_boundaries(const SetupArgs& a, int64_t* boundary, GroupWindow w, RowRange chunk,
                                  int64_t row) {
  for (int64_t g = chunk.begin; g < chunk.end; ++g) {
    if (g == w.first) boundary[0] = row;
    row = next_row_boundary(row, load_group_size(a.group_sizes, g), a.m);
    if (g >= w.first) boundary[g - w.first + 1] = row;
  }
}

// Written once (thread 0), after the chunks: boundary[0] when no chunk holds w.first (no
// group in the window: every row is padding).
GG_HD void write_empty_window_boundary(int64_t* boundary, GroupWindow w) {
  if (w.first == w.last) boundary[0] = 0;
}

// The whole window: where the scan's result lives, and how to read a group's rows.
struct WindowRows {
  const int64_t* boundary;
  GroupWindow window;
  int64_t group_offset;
  GG_HD RowRange group(int64_t local) const { return local_group_rows(boundary, window, group_offset, local); }
  GG_HD RowRange owned() const { return owned_rows(boundary, window); }
};

// The window as the setup wrote it into the workspace, for the steps after it.
GG_HD WindowRows workspace_rows(const WorkspaceView& ws) {
  return {ws.boundary, ws.window->window, ws.window->group_offset};
}

// Local group `local`'s problem in GEMM set `s`.
GG_HD GroupProblem gemm_problem(const GemmSetup& s, RowRange rows, int64_t local) {
  return s.kind == SetupKind::wgrad ? wgrad_problem(rows, local, s.k, s.n, s.accumulate)
                                    : forward_problem(rows, local, s.k, s.n, s.transpose_rhs, s.c_is_output);
}

// Written by one block after the scan: the window's header.
GG_HD void write_header(const WorkspaceView& ws, const WindowRows& rows) {
  *ws.window = WindowHeader{rows.window, rows.group_offset, 0};
}

// A set without an output (a backward that does not want that gradient) stays unwritten:
// no GEMM reads it.
GG_HD void write_set(const GemmSetup& s, const GemmArrays& arrays, const WindowRows& rows, int64_t local) {
  if (s.operands.d) write_group(arrays, local, gemm_problem(s, rows.group(local), local), s.operands);
}

// The sets by constant index: indexing the kernel's argument at run time would copy it to
// local memory.
GG_HD void write_group_setup(const SetupArgs& a, const WorkspaceView& ws, const WindowRows& rows,
                             int64_t local) {
  static_assert(kGemmSets == 2, "one line per GEMM set");
  if (a.num_gemms > 0) write_set(a.gemm[0], ws.gemm[0], rows, local);
  if (a.num_gemms > 1) write_set(a.gemm[1], ws.gemm[1], rows, local);
}

// What the setup writes into output row `row` of the row fill: nothing (a GEMM writes it),
// zeros, or the bias row of a local group.
struct RowFillAction {
  bool write;
  int64_t bias_local;  // local group whose bias row to copy, or -1 for zeros
};

GG_HD RowFillAction row_fill_action(const RowFill& f, const WindowRows& rows, int64_t row) {
  const RowRange owned = rows.owned();
  if (row < owned.begin || row >= owned.end) return {true, -1};  // padding
  if (!f.owned_rows) return {false, -1};
  if (f.bias == nullptr) return {true, -1};
  const int64_t g = group_of_row(rows.boundary, rows.window, row);  // owned: g >= 0
  return {true, g - rows.group_offset};
}

// Whether the group fill zeroes local group `local`'s block (its set by constant index, as
// in write_group_setup).
GG_HD bool group_fill_zeroes(const SetupArgs& a, const WindowRows& rows, int64_t local) {
  const RowRange r = rows.group(local);
  const GroupAction action =
      a.groups.set == 0 ? gemm_problem(a.gemm[0], r, local).action : gemm_problem(a.gemm[1], r, local).action;
  return action == GroupAction::write_zero;
}

// The fills' work as units a grid strides over: one per output row of the row fill, then
// each group block of the group fill in chunks of up to kGroupFillChunkBytes.
constexpr int64_t kGroupFillChunkBytes = int64_t(64) << 10;

GG_HD int64_t group_fill_chunks(const SetupArgs& a) {
  return a.groups.out ? ceil_div(a.groups.block_bytes, kGroupFillChunkBytes) : 0;
}

GG_HD int64_t fill_units(const SetupArgs& a) {
  return (a.rows.out ? a.m : 0) + a.num_groups * group_fill_chunks(a);
}

// A unit of the group fill: local group `local`'s bytes [begin, end) of its block.
struct GroupFillUnit {
  int64_t local;
  int64_t begin, end;  // bytes
};

GG_HD GroupFillUnit group_fill_unit(const SetupArgs& a, int64_t unit) {
  const int64_t chunks = group_fill_chunks(a);
  const int64_t index = unit - (a.rows.out ? a.m : 0);
  const int64_t begin = (index % chunks) * kGroupFillChunkBytes;
  const int64_t end = begin + kGroupFillChunkBytes;
  return {index / chunks, begin, end < a.groups.block_bytes ? end : a.groups.block_bytes};
}

// Bias gradient order: lane l of kBiasGradLanes sums rows begin + l, begin + l + lanes, ...
// of a column in row order; the lanes' partial sums are then added in lane order. Fixed by
// the constant alone, so every call sums in the same order: deterministic, no atomics.
constexpr int kBiasGradLanes = 16;

}  // namespace groupgemm
