// The schedule arithmetic of a grouped GEMM: which rows belong to which local group,
// which rows are padding, and what an empty group does.
//
// Every function here is __host__ __device__: the CUDA setup kernel and the CPU backend
// run exactly this code, so the CPU tests exercise the logic the GPU path relies on.
// All arithmetic is int64 and saturates at M, so no sum of sizes can overflow or
// index past the end of lhs.
#pragma once

#include <cstdint>
#include <climits>

#include "groupgemm/types.h"

#if defined(__CUDACC__)
#define GG_HD __host__ __device__ __forceinline__
#else
#define GG_HD inline
#endif

namespace groupgemm {

// Reads element i of an int32 or int64 array.
GG_HD int64_t load_index(const void* data, IndexType type, int64_t i) {
  return type == IndexType::i32 ? static_cast<int64_t>(static_cast<const int32_t*>(data)[i])
                                : static_cast<const int64_t*>(data)[i];
}

// group_offset, a scalar in device memory; absent means 0.
GG_HD int64_t read_group_offset(const IndexArray& offset) {
  return offset.data ? load_index(offset.data, offset.type, 0) : 0;
}

// A negative group size counts as 0.
GG_HD int64_t clamp_group_size(int64_t raw) { return raw > 0 ? raw : 0; }

// Group g's raw size: the entry itself, or for cumulative ends the difference of two,
// where a decrease counts as 0 and a difference past int64 saturates (both are clamped to
// the row count later anyway).
GG_HD int64_t load_group_size(const IndexArray& sizes, int64_t g) {
  const int64_t raw = load_index(sizes.data, sizes.type, g);
  if (!sizes.cumulative) return raw;
  const int64_t previous = g > 0 ? load_index(sizes.data, sizes.type, g - 1) : 0;
  if (raw <= previous) return 0;
  const uint64_t diff = static_cast<uint64_t>(raw) - static_cast<uint64_t>(previous);
  return diff > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(diff);
}

// Row where the next group starts, given where this one starts. Clipped to m, so rows
// past sum(sizes) > m are simply not owned; written so that begin + size cannot overflow.
GG_HD int64_t next_row_boundary(int64_t begin, int64_t raw_size, int64_t m) {
  const int64_t size = clamp_group_size(raw_size);
  return size >= m - begin ? m : begin + size;
}

// The local window: global groups [first, last) held by this call's rhs, clipped to the
// groups that exist. Local group l is global group group_offset + l.
struct GroupWindow {
  int64_t first;
  int64_t last;
};

GG_HD GroupWindow group_window(int64_t group_offset, int64_t num_local, int64_t num_total) {
  const int64_t first = group_offset < 0 ? 0 : (group_offset > num_total ? num_total : group_offset);
  // Compared before adding, so a huge offset cannot overflow group_offset + num_local.
  int64_t last = group_offset > num_total - num_local ? num_total : group_offset + num_local;
  if (last < first) last = first;
  return {first, last};
}

// Global index of local group l, or -1 when it is outside the existing groups.
GG_HD int64_t global_group(GroupWindow w, int64_t group_offset, int64_t local) {
  const int64_t g = group_offset + local;
  return (g >= w.first && g < w.last) ? g : -1;
}

// Row range [begin, end) of one group.
struct RowRange {
  int64_t begin;
  int64_t end;
  GG_HD int64_t rows() const { return end - begin; }
};

// Folds groups [begin, end) onto the row where group `begin` starts: the row where
// group `end` starts. The CPU walks the whole window with it; each CUDA setup thread
// folds one chunk of groups before a block scan joins the chunks.
GG_HD int64_t fold_row_boundary(const IndexArray& sizes, int64_t begin, int64_t end, int64_t row, int64_t m) {
  for (int64_t g = begin; g < end; ++g) row = next_row_boundary(row, load_group_size(sizes, g), m);
  return row;
}

// Row boundaries of the window's groups: boundary[i] = min(sum(sizes[:w.first + i]), m)
// for i in [0, w.last - w.first], so group w.first + i owns [boundary[i], boundary[i + 1]).
// `boundary` has w.last - w.first + 1 entries.
GG_HD void window_row_boundaries(const IndexArray& sizes, GroupWindow w, int64_t m, int64_t* boundary) {
  int64_t row = fold_row_boundary(sizes, 0, w.first, 0, m);
  boundary[0] = row;
  for (int64_t g = w.first; g < w.last; ++g) {
    row = next_row_boundary(row, load_group_size(sizes, g), m);
    boundary[g - w.first + 1] = row;
  }
}

// Rows of local group `local`, given the window's boundaries.
GG_HD RowRange local_group_rows(const int64_t* boundary, GroupWindow w, int64_t group_offset, int64_t local) {
  const int64_t g = global_group(w, group_offset, local);
  if (g < 0) return {0, 0};
  return {boundary[g - w.first], boundary[g - w.first + 1]};
}

// Rows owned by the window's groups. Everything else is padding, written as exact zeros.
GG_HD RowRange owned_rows(const int64_t* boundary, GroupWindow w) {
  return {boundary[0], boundary[w.last - w.first]};
}

GG_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Which global group owns `row`, or -1 for padding: a binary search over the window's
// boundaries that skips empty groups.
GG_HD int64_t group_of_row(const int64_t* boundary, GroupWindow w, int64_t row) {
  const int64_t count = w.last - w.first;
  if (count == 0 || row < boundary[0] || row >= boundary[count]) return -1;
  int64_t lo = 0, hi = count;  // invariant: boundary[lo] <= row < boundary[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (boundary[mid] <= row)
      lo = mid;
    else
      hi = mid;
  }
  return w.first + lo;
}

// What a group's output block gets. An empty group never reaches a GEMM (a k = 0
// contraction is where other libraries produce garbage): it is written as zeros, or,
// when accumulating, left bit-for-bit untouched.
enum class GroupAction : int { gemm = 0, write_zero = 1, leave_untouched = 2 };

// wgrad / dbias: the contraction runs over the group's rows.
GG_HD GroupAction reduction_action(int64_t rows, bool accumulate) {
  if (rows > 0) return GroupAction::gemm;
  return accumulate ? GroupAction::leave_untouched : GroupAction::write_zero;
}

// forward / dgrad: the contraction runs over K; an empty K gives bias (or zero) rows.
GG_HD GroupAction forward_action(int64_t rows, int64_t k) {
  if (rows == 0) return GroupAction::leave_untouched;  // no rows to write
  return k > 0 ? GroupAction::gemm : GroupAction::write_zero;
}

}  // namespace groupgemm
