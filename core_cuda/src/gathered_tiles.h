// The arithmetic of the sm_90a gathered GEMM (cuda/cutlass_gathered_sm90.cuh) that decides
// what each block and each loading thread touches: which group a persistent block's tile
// belongs to, which 16-byte pieces of an operand tile a thread copies, and how many bytes
// of a piece lie inside the problem. __host__ __device__ (schedule.h's GG_HD), so the core
// tests check that every tile and every element is covered exactly once without a GPU.
#pragma once

#include <cstdint>

#include "groupgemm/schedule.h"

namespace groupgemm {

// One tile of the persistent sequence: its group, its first row and column, and the
// group's problem (m, n, k).
struct GatheredTile {
  int group, m0, n0, m, n, k;

  // The k tiles of kTileK its mainloop runs: the loading and the computing warps both count them.
  template <int kTileK>
  GG_HD int k_tiles() const {
    return (k + kTileK - 1) / kTileK;
  }
};

// Finds the group of each of a block's tiles (block b takes tiles b, b + blocks, ...), from
// the int32 (m, n, k) problems only the device holds. A block's tiles only grow, so the walk
// resumes where the previous one was found: O(G + tiles) per block, as CUTLASS 2.x's
// device-only problem visitor. A group with m = 0 or n = 0 has no tiles.
template <int kTileM, int kTileN>
class GroupTileWalker {
 public:
  GG_HD GroupTileWalker(const int32_t* problems, int num_groups) : problems_(problems), num_groups_(num_groups) {}

  // False once `tile` is past the last group's tiles.
  GG_HD bool find(int64_t tile, GatheredTile& out) {
    for (; group_ < num_groups_; ++group_) {
      const int m = problems_[3 * group_], n = problems_[3 * group_ + 1], k = problems_[3 * group_ + 2];
      const int64_t tiles_n = (n + kTileN - 1) / kTileN;
      const int64_t count = (m + kTileM - 1) / kTileM * tiles_n;
      if (tile < first_ + count) {
        const int64_t local = tile - first_;
        out = {group_, int(local / tiles_n) * kTileM, int(local % tiles_n) * kTileN, m, n, k};
        return true;
      }
      first_ += count;
    }
    return false;
  }

 private:
  const int32_t* problems_;
  int num_groups_;
  int group_ = 0;
  int64_t first_ = 0;  // the first tile of group_
};

// How kThreads loading threads split an operand tile of kRows rows of kContiguous elements
// (the contiguous dimension in memory) into 16-byte pieces of kVector elements: thread t
// copies the piece starting at column col(t) of rows row(t, 0), ..., row(t, kPasses - 1).
template <int kContiguous, int kRows, int kVector, int kThreads>
struct TilePieces {
  static constexpr int kTileCols = kContiguous, kTileRows = kRows, kPieceValues = kVector, kLoadThreads = kThreads;
  static constexpr int kPerRow = kContiguous / kVector;
  static constexpr int kRowsPerPass = kThreads / kPerRow;
  static constexpr int kPasses = kRows / kRowsPerPass;
  static_assert(kContiguous % kVector == 0 && kThreads % kPerRow == 0 && kRows % kRowsPerPass == 0,
                "the tile does not split into whole passes of 16-byte pieces");

  GG_HD static int col(int thread) { return thread % kPerRow * kVector; }
  GG_HD static int row(int thread, int pass) { return thread / kPerRow + pass * kRowsPerPass; }
};

// Bytes of a 16-byte piece of `element_bytes`-byte values inside the problem, when `left`
// values remain from the piece's start to the problem's edge; the rest is zero-filled.
GG_HD int piece_bytes(int left, int element_bytes) {
  return left * element_bytes >= 16 ? 16 : left > 0 ? left * element_bytes : 0;
}

// Where a loading thread's piece of an operand tile comes from. The operand is stored as
// rows of contiguous values; a tile's rows and its columns (TilePieces' rows and columns)
// each cover a span of one problem dimension: the contraction (K) from the k tile's first
// k, or the product's M or N from the tile's m0 or n0. A [M, K] and B [N, K] tiles' rows
// run along M and N, A [K, M] and B [K, N] tiles' rows along K.
struct TileSpan {
  int first, extent;  // the span's first index and the problem's size along it
};
struct TileSpans {
  TileSpan rows, cols;
};
// An A tile's spans for the k tile from k0: rows along K for A [K, M], else along M.
GG_HD TileSpans a_tile_spans(bool rows_along_k, const GatheredTile& t, int k0) {
  const TileSpan k{k0, t.k}, m{t.m0, t.m};
  return rows_along_k ? TileSpans{k, m} : TileSpans{m, k};
}
// A B tile's: rows along K for B [K, N], else along N.
GG_HD TileSpans b_tile_spans(bool rows_along_k, const GatheredTile& t, int k0) {
  const TileSpan k{k0, t.k}, n{t.n0, t.n};
  return rows_along_k ? TileSpans{k, n} : TileSpans{n, k};
}

// The storage row of tile row r: the index array's entry when the operand's rows are the
// gathered ones (indices not null); -1 past the problem.
GG_HD int64_t storage_row(TileSpan rows, int r, const int32_t* indices) {
  const int i = rows.first + r;
  return i >= rows.extent ? -1 : indices ? int64_t(indices[i]) : int64_t(i);
}

// The bytes a piece at tile column col of storage row `row` (storage_row's) reads: 0 for
// no row, fewer than 16 at the problem's edge. It starts at column cols.first + col.
GG_HD int piece_bytes_at(int64_t row, TileSpan cols, int col, int element_bytes) {
  return row < 0 ? 0 : piece_bytes(cols.extent - (cols.first + col), element_bytes);
}

}  // namespace groupgemm
