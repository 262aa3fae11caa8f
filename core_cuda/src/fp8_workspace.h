// The CUDA backend's workspace for the FP8 calls, and the __host__ __device__ steps of
// their setup kernels: what each local group's GEMM reads (problem size, operand, scale
// and output pointers, leading dimensions) and where the re-laid scales and the
// 128-token-aligned weight-gradient operands go. The caller provides the memory, so
// nothing is allocated at run time and a CUDA graph can replay the call; the core tests
// run these steps on the host and execute the resulting problems.
//
// Why the CUDA path re-lays scales: the sm_90a blockwise-scaled grouped GEMM (CUTLASS 3.x)
// reads a group's scales M-major and packed per group, [ceil(K/128)][M_g] for lhs and
// [ceil(K/128)][N] (one scale per output channel) for rhs, the layout it derives from the
// group's problem shape. The API's layouts (groupgemm/fp8.h) are DeepSeek-V3's, so a small
// kernel copies them into that form. Rowwise scales become the same blockwise form with
// every block of a row (channel) holding its one scale, so one kernel serves both recipes.
// The weight gradient's groups start at any token; TMA needs 16-byte aligned rows, so its
// operands are copied with each group's tokens starting at a multiple of 128 (zeros fill
// the last block), where its token blocks and scale rows line up.
#pragma once

#include <cstdint>

#include "groupgemm/fp8_blocks.h"
#include "workspace.h"

namespace groupgemm {

struct Fp8WorkspaceLayout {
  int64_t window;       // WindowHeader
  int64_t boundary;     // int64[G + 1]: the window's row boundaries
  int64_t first_block;  // int64[G + 1]: each local group's first token block, then the total
  int64_t problem;      // int32[3 G]: (m, n, k) per group; 0s for a group without a GEMM
  int64_t ptr[6];       // void*[G] each: A, B, C, D, scales of A, scales of B
  int64_t ld[4];        // int64[G] each: lda, ldb, ldc, ldd
  int64_t scale_a;      // float: A's scales as the kernel reads them (0 bytes when the API's serve)
  int64_t scale_b;      // float: B's scales likewise
  int64_t operand_a;    // weight gradient: A [K, T] with each group at a multiple of 128 tokens
  int64_t operand_b;    // weight gradient: B [N, T] likewise
  int64_t kernel;       // the GEMM kernel's own workspace, plus alignment slack
  int64_t bytes;
  int64_t aligned_tokens;  // weight gradient: T, 128 x token_block_bound(M, G)
};

// The layout for a call of `call` with G local groups and shape (m, k, n) (fp8.h's
// fp8_workspace_bytes); kernel_bytes: the GEMM kernel's own workspace on the device.
GG_HD Fp8WorkspaceLayout fp8_workspace_layout(Fp8Call call, Fp8Scaling scaling, int64_t g, int64_t m,
                                              int64_t k, int64_t n, int64_t kernel_bytes) {
  Fp8WorkspaceLayout l{};
  int64_t at = 0;
  auto take = [&at](int64_t bytes) {
    const int64_t here = at;
    at += align16(bytes);
    return here;
  };
  const bool gemm = call != Fp8Call::quantize_grouped;
  l.window = take(sizeof(WindowHeader));
  l.boundary = take((g + 1) * 8);
  l.first_block = take((g + 1) * 8);
  l.problem = take(gemm ? g * 3 * 4 : 0);
  for (int i = 0; i < 6; ++i) l.ptr[i] = take(gemm ? g * 8 : 0);
  for (int i = 0; i < 4; ++i) l.ld[i] = take(gemm ? g * 8 : 0);
  int64_t scale_a = 0, scale_b = 0, operand_a = 0, operand_b = 0;
  if (call == Fp8Call::matmul) {
    scale_a = m * fp8_blocks(k) * 4;
    scale_b = g * fp8_blocks(k) * n * 4;
  } else if (call == Fp8Call::wgrad) {
    const int64_t blocks = token_block_bound(m, g);
    l.aligned_tokens = blocks * kFp8Block;
    operand_a = k * l.aligned_tokens;
    operand_b = n * l.aligned_tokens;
    if (scaling == Fp8Scaling::rowwise) scale_a = blocks * k * 4, scale_b = blocks * n * 4;
  }
  l.scale_a = take(scale_a);
  l.scale_b = take(scale_b);
  l.operand_a = take(operand_a);
  l.operand_b = take(operand_b);
  l.kernel = take(gemm && kernel_bytes > 0 ? kernel_bytes + kKernelWorkspaceAlignment - 16 : 0);
  l.bytes = at;
  return l;
}

// Typed views of a workspace laid out by `l`.
struct Fp8WorkspaceView {
  WindowHeader* window;
  int64_t* boundary;
  int64_t* first_block;
  int32_t* problem;
  void** ptr[6];
  int64_t* ld[4];
  float* scale_a;
  float* scale_b;
  uint8_t* operand_a;
  uint8_t* operand_b;
};

GG_HD Fp8WorkspaceView fp8_workspace_view(void* base, const Fp8WorkspaceLayout& l) {
  char* b = static_cast<char*>(base);
  Fp8WorkspaceView v{};
  v.window = reinterpret_cast<WindowHeader*>(b + l.window);
  v.boundary = reinterpret_cast<int64_t*>(b + l.boundary);
  v.first_block = reinterpret_cast<int64_t*>(b + l.first_block);
  v.problem = reinterpret_cast<int32_t*>(b + l.problem);
  for (int i = 0; i < 6; ++i) v.ptr[i] = reinterpret_cast<void**>(b + l.ptr[i]);
  for (int i = 0; i < 4; ++i) v.ld[i] = reinterpret_cast<int64_t*>(b + l.ld[i]);
  v.scale_a = reinterpret_cast<float*>(b + l.scale_a);
  v.scale_b = reinterpret_cast<float*>(b + l.scale_b);
  v.operand_a = reinterpret_cast<uint8_t*>(b + l.operand_a);
  v.operand_b = reinterpret_cast<uint8_t*>(b + l.operand_b);
  return v;
}

// The GEMM kernel's region, aligned up to kKernelWorkspaceAlignment, and its bytes.
GG_HD KernelWorkspace fp8_kernel_workspace(void* base, int64_t total_bytes, const Fp8WorkspaceLayout& l) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(static_cast<char*>(base) + l.kernel);
  const uintptr_t a = static_cast<uintptr_t>(kKernelWorkspaceAlignment);
  const uintptr_t aligned = (at + a - 1) / a * a;
  const int64_t used = l.kernel + static_cast<int64_t>(aligned - at);
  return {reinterpret_cast<void*>(aligned), total_bytes > used ? total_bytes - used : 0};
}

// ---- the setup kernel's steps ------------------------------------------------------
// One thread block: the window's row boundaries by a saturating scan over chunks of the
// groups (schedule.h's arithmetic, as the 16-bit GEMMs' setup), then first_block, the
// exclusive scan of each local group's token blocks (ceil(rows / 128); first_block[G] is
// their total), then each local group's GEMM.

enum class Fp8SetupKind : int { matmul = 0, wgrad = 1, rows_only = 2 };

// The call's operands and the caller's scales.
struct Fp8Operands {
  const void* a;
  const void* b;
  void* d;
  const float* a_scale;
  const float* b_scale;
  int64_t d_bytes;  // output element size
};

struct Fp8SetupArgs {
  Fp8SetupKind kind;
  Fp8Scaling scaling;
  IndexArray group_sizes;
  IndexArray group_offset;
  int64_t num_groups, m, k, n;  // as fp8_workspace_layout's
  Fp8Operands operands;
  Fp8WorkspaceLayout layout;
  void* workspace;
};

// Thread `t` of `threads` takes the contiguous chunk [begin, end) of [0, count).
GG_HD RowRange fp8_setup_chunk(int64_t t, int64_t threads, int64_t count) {
  const int64_t chunk = ceil_div(count, threads);
  const int64_t begin = t * chunk < count ? t * chunk : count;
  return {begin, begin + chunk < count ? begin + chunk : count};
}

// Rows of a chunk of global groups: what the row scan combines (min(a + b, m)).
GG_HD int64_t fp8_chunk_rows(const Fp8SetupArgs& a, RowRange chunk) {
  return fold_row_boundary(a.group_sizes.data, a.group_sizes.type, chunk.begin, chunk.end, 0, a.m);
}

// Given the row where the chunk of global groups starts, writes the window's boundaries
// that fall in it.
GG_HD void write_fp8_boundaries(const Fp8SetupArgs& a, const Fp8WorkspaceView& ws, GroupWindow w,
                                RowRange chunk, int64_t row) {
  for (int64_t g = chunk.begin; g < chunk.end; ++g) {
    if (g == w.first) ws.boundary[0] = row;
    row = next_row_boundary(row, load_index(a.group_sizes.data, a.group_sizes.type, g), a.m);
    if (g >= w.first) ws.boundary[g - w.first + 1] = row;
  }
}

// Written once: the window, and boundary[0] when no chunk holds w.first.
GG_HD void write_fp8_window(const Fp8WorkspaceView& ws, GroupWindow w, int64_t group_offset) {
  *ws.window = WindowHeader{w, group_offset, 0};
  if (w.first == w.last) ws.boundary[0] = 0;
}

// Rows of local group `local` from the written boundaries.
GG_HD RowRange fp8_group_rows(const Fp8WorkspaceView& ws, int64_t local) {
  return local_group_rows(ws.boundary, ws.window->window, ws.window->group_offset, local);
}

// Token blocks of a chunk of local groups: what the block scan adds up.
GG_HD int64_t fp8_chunk_blocks(const Fp8WorkspaceView& ws, RowRange chunk) {
  int64_t blocks = 0;
  for (int64_t l = chunk.begin; l < chunk.end; ++l) blocks += fp8_blocks(fp8_group_rows(ws, l).rows());
  return blocks;
}

// Given the first block of the chunk, writes first_block of its local groups.
GG_HD void write_fp8_first_blocks(const Fp8WorkspaceView& ws, RowRange chunk, int64_t first) {
  for (int64_t l = chunk.begin; l < chunk.end; ++l) {
    ws.first_block[l] = first;
    first += fp8_blocks(fp8_group_rows(ws, l).rows());
  }
}

// Writes one group's GEMM: (m, n, k) and its pointers and leading dimensions, or a
// 0 x 0 x 0 problem when it has nothing to multiply (no rows, or K = 0), so no k = 0
// problem reaches the kernel. C is D: the output holds the bias rows (or, accumulating,
// the float32 sums) the epilogue adds with beta = 1.
GG_HD void write_fp8_group(const Fp8WorkspaceView& ws, int64_t local, bool gemm, int64_t m, int64_t n,
                           int64_t k, const void* a, const void* b, void* d, const float* a_scale,
                           const float* b_scale, int64_t lda, int64_t ldb, int64_t ldd) {
  ws.problem[3 * local + 0] = gemm ? static_cast<int32_t>(m) : 0;
  ws.problem[3 * local + 1] = gemm ? static_cast<int32_t>(n) : 0;
  ws.problem[3 * local + 2] = gemm ? static_cast<int32_t>(k) : 0;
  ws.ptr[0][local] = const_cast<void*>(a);
  ws.ptr[1][local] = const_cast<void*>(b);
  ws.ptr[2][local] = d;
  ws.ptr[3][local] = d;
  ws.ptr[4][local] = const_cast<float*>(a_scale);
  ws.ptr[5][local] = const_cast<float*>(b_scale);
  ws.ld[0][local] = lda;
  ws.ld[1][local] = ldb;
  ws.ld[2][local] = ldd;
  ws.ld[3][local] = ldd;
}

// After the boundaries and first blocks: local group `local`'s GEMM.
//   matmul: A = lhs rows [M_g, K], B = rhs[g] [N, K] (K-major), D = out rows [M_g, N]; the
//     scales in the workspace at [Kb][M_g] from Kb * rows.begin, and [Kb][N] from g * Kb * N.
//   wgrad: A = the aligned copy of lhs [K, T] from column 128 * first_block, B likewise
//     [N, T], contracting over the group's blocks (its zero tail adds exact zeros); D =
//     out[g] [K, N]. Blockwise scales are the caller's [B, K] and [B, N] from row
//     first_block; rowwise ones their per-block copies in the workspace.
GG_HD void write_fp8_group_setup(const Fp8SetupArgs& a, const Fp8WorkspaceView& ws, int64_t local) {
  const RowRange rows = fp8_group_rows(ws, local);
  const Fp8Operands& ops = a.operands;
  if (a.kind == Fp8SetupKind::matmul) {
    const int64_t kb = fp8_blocks(a.k);
    write_fp8_group(ws, local, rows.rows() > 0 && a.k > 0, rows.rows(), a.n, a.k,
                    static_cast<const uint8_t*>(ops.a) + rows.begin * a.k,
                    static_cast<const uint8_t*>(ops.b) + local * a.n * a.k,
                    static_cast<char*>(ops.d) + rows.begin * a.n * ops.d_bytes, ws.scale_a + kb * rows.begin,
                    ws.scale_b + local * kb * a.n, a.k, a.k, a.n);
    return;
  }
  const int64_t first = ws.first_block[local], tokens = a.layout.aligned_tokens;
  const bool rowwise = a.scaling == Fp8Scaling::rowwise;
  write_fp8_group(ws, local, rows.rows() > 0, a.k, a.n, fp8_blocks(rows.rows()) * kFp8Block,
                  ws.operand_a + first * kFp8Block, ws.operand_b + first * kFp8Block,
                  static_cast<char*>(ops.d) + local * a.k * a.n * ops.d_bytes,
                  (rowwise ? ws.scale_a : ops.a_scale) + first * a.k,
                  (rowwise ? ws.scale_b : ops.b_scale) + first * a.n, tokens, tokens, a.n);
}

// ---- the element steps of the copy kernels (one thread per element on the GPU) -------

// Matmul lhs scale: the kernel's entry of block kb for `row` in the [Kb][M_g] block of the
// group owning it; -1 for a padding row (no entry).
GG_HD int64_t fp8_lhs_scale_slot(const Fp8WorkspaceView& ws, int64_t row, int64_t kb, int64_t kb_count) {
  const int64_t g = group_of_row(ws.boundary, ws.window->window, row);
  if (g < 0) return -1;
  const RowRange rows = fp8_group_rows(ws, g - ws.window->group_offset);
  return kb_count * rows.begin + kb * rows.rows() + (row - rows.begin);
}

// Matmul rhs scale for the kernel's entry (g, kb, col) of [G][Kb][N], from the API's.
GG_HD float fp8_rhs_scale(Fp8Scaling scaling, const float* rhs_scale, int64_t g, int64_t kb, int64_t col,
                          int64_t n, int64_t kb_count) {
  return rhs_scale[rhs_scale_index(scaling, g, col, n, kb, kb_count)];
}

// The local group whose token blocks hold `block` (first_block[l] <= block <
// first_block[l + 1]: a group with blocks), or -1 past the last used block.
GG_HD int64_t fp8_group_of_block(const Fp8WorkspaceView& ws, int64_t num_groups, int64_t block) {
  if (block < 0 || block >= ws.first_block[num_groups]) return -1;
  int64_t lo = 0, hi = num_groups;  // invariant: first_block[lo] <= block < first_block[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (ws.first_block[mid] <= block)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Weight gradient: the source token of aligned column `col`, or -1 where the copy holds
// a zero (a group's last block past its rows, or a block no group uses).
GG_HD int64_t fp8_aligned_source_token(const Fp8WorkspaceView& ws, int64_t num_groups, int64_t col) {
  const int64_t l = fp8_group_of_block(ws, num_groups, col / kFp8Block);
  if (l < 0) return -1;
  const RowRange rows = fp8_group_rows(ws, l);
  const int64_t token = rows.begin + (col - ws.first_block[l] * kFp8Block);
  return token < rows.end ? token : -1;
}

// Matmul output rows no GEMM writes, and the bias rows the epilogue adds to: padding rows
// are zeros; an owned row holds its group's bias (local group index), or zeros when K = 0
// (nothing else writes it); otherwise the GEMM writes it alone (write = false).
struct Fp8RowFill {
  bool write;
  int64_t bias_group;  // local group of the bias row to copy, or -1 for zeros
};

GG_HD Fp8RowFill fp8_row_fill(const Fp8WorkspaceView& ws, int64_t row, bool has_bias, bool k_is_zero) {
  const int64_t g = group_of_row(ws.boundary, ws.window->window, row);
  if (g < 0) return {true, -1};
  if (has_bias) return {true, g - ws.window->group_offset};
  return {k_is_zero, -1};
}

}  // namespace groupgemm
