// The CUDA backend's workspace for the FP8 calls, and the __host__ __device__ steps of
// their kernels. It begins with the 16-bit GEMMs' workspace (workspace.h): the setup
// kernel (setup.h) writes its window, row boundaries and, for the forward, GEMM set 0, and
// fills the output rows and groups no GEMM writes, as it does for the 16-bit GEMMs. After
// it come what only the FP8 calls need: each local group's first token block, its scale
// pointers, the re-laid scales and the 128-token-aligned weight-gradient operands. The
// caller provides the memory, so nothing is allocated at run time and a CUDA graph can
// replay the call; the core tests run these steps on the host.
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
#include "setup.h"

namespace groupgemm {

// The GEMM set of the 16-bit workspace the FP8 grouped GEMM reads (problems, A, B, C, D
// and their leading dimensions).
constexpr int kFp8GemmSet = 0;

struct Fp8WorkspaceLayout {
  WorkspaceLayout base;  // workspace.h's for G groups, without a kernel region
  int64_t first_block;   // int64[G + 1]: each local group's first token block, then the total
  int64_t scale_ptr[2];  // float*[G] each: the scales of A and of B per group
  int64_t scale_a;       // float: A's scales as the kernel reads them (0 bytes when the API's serve)
  int64_t scale_b;       // float: B's scales likewise
  int64_t operand_a;     // weight gradient: A [K, T] with each group at a multiple of 128 tokens
  int64_t operand_b;     // weight gradient: B [N, T] likewise
  int64_t kernel;        // the GEMM kernel's own workspace, plus alignment slack
  int64_t bytes;
  int64_t aligned_tokens;  // weight gradient: T, 128 x token_block_bound(M, G)
};

// The layout for a call of `call` with G local groups and shape (m, k, n) (fp8.h's
// fp8_workspace_bytes); kernel_bytes: the GEMM kernel's own workspace on the device.
GG_HD Fp8WorkspaceLayout fp8_workspace_layout(Fp8Call call, Fp8Scaling scaling, int64_t g, int64_t m,
                                              int64_t k, int64_t n, int64_t kernel_bytes) {
  Fp8WorkspaceLayout l{};
  l.base = workspace_layout(g);
  int64_t at = l.base.bytes;
  auto take = [&at](int64_t bytes) {
    const int64_t here = at;
    at += align16(bytes);
    return here;
  };
  const bool gemm = call != Fp8Call::quantize_grouped;
  l.first_block = take((g + 1) * 8);
  for (int64_t& array : l.scale_ptr) array = take(gemm ? g * 8 : 0);
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
  WorkspaceView base;
  int64_t* first_block;
  const float** scale_ptr[2];
  float* scale_a;
  float* scale_b;
  uint8_t* operand_a;
  uint8_t* operand_b;
};

GG_HD Fp8WorkspaceView fp8_workspace_view(void* base, int64_t num_groups, const Fp8WorkspaceLayout& l) {
  char* b = static_cast<char*>(base);
  Fp8WorkspaceView v{};
  v.base = workspace_view(base, num_groups);
  v.first_block = reinterpret_cast<int64_t*>(b + l.first_block);
  for (int i = 0; i < 2; ++i) v.scale_ptr[i] = reinterpret_cast<const float**>(b + l.scale_ptr[i]);
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

// ---- the steps after the setup kernel ------------------------------------------------

enum class Fp8SetupKind : int { matmul = 0, wgrad = 1, quantize_grouped = 2 };

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
  bool accumulate;              // wgrad: into the output
  int64_t num_groups, m, k, n;  // as fp8_workspace_layout's
  Fp8Operands operands;
  Fp8WorkspaceLayout layout;
  void* workspace;
};

GG_HD Fp8WorkspaceView fp8_view(const Fp8SetupArgs& a) {
  return fp8_workspace_view(a.workspace, a.num_groups, a.layout);
}

// Token blocks of a chunk of local groups (ceil(rows / 128) each): what the block scan of
// the token-block kernel adds up.
GG_HD int64_t chunk_token_blocks(const WindowRows& rows, RowRange chunk) {
  int64_t blocks = 0;
  for (int64_t l = chunk.begin; l < chunk.end; ++l) blocks += fp8_blocks(rows.group(l).rows());
  return blocks;
}

// Given the first block of the chunk, writes first_block of its local groups.
GG_HD void write_first_blocks(int64_t* first_block, const WindowRows& rows, RowRange chunk, int64_t first) {
  for (int64_t l = chunk.begin; l < chunk.end; ++l) {
    first_block[l] = first;
    first += fp8_blocks(rows.group(l).rows());
  }
}

// Weight gradient: out[local] [K, N] (+)= A B^T over the group's token blocks, A the
// aligned copy of lhs [K, T] from column 128 * first_block and B likewise of rhs [N, T],
// both K-major as the kernel reads them (the group's zero tail adds exact zeros). C is D:
// what an accumulating call adds to. An empty group has no GEMM (reduction_action).
GG_HD GroupProblem fp8_wgrad_problem(RowRange rows, int64_t first_block, int64_t local, int64_t k, int64_t n,
                                     int64_t aligned_tokens, bool accumulate) {
  GroupProblem p{};
  p.action = reduction_action(rows.rows(), accumulate);
  p.m = k, p.n = n, p.k = fp8_blocks(rows.rows()) * kFp8Block;
  p.a_transposed = false, p.b_transposed = true;
  p.a_offset = p.b_offset = first_block * kFp8Block;
  p.lda = p.ldb = aligned_tokens;
  p.c_offset = p.d_offset = local * k * n;
  p.ldc = p.ldd = n;
  return p;
}

// Local group `local`'s scale pointers, after the setup and (weight gradient) the first
// blocks:
//   matmul: the workspace's re-laid scales, [Kb][M_g] from Kb * rows.begin and [Kb][N]
//     from local * Kb * N;
//   wgrad: blockwise, the caller's [B, K] and [B, N] from row first_block; rowwise, their
//     per-block copies in the workspace.
GG_HD void write_scale_pointers(const Fp8SetupArgs& a, const Fp8WorkspaceView& ws, int64_t local) {
  if (a.kind == Fp8SetupKind::matmul) {
    const int64_t kb = fp8_blocks(a.k);
    ws.scale_ptr[0][local] = ws.scale_a + kb * workspace_rows(ws.base).group(local).begin;
    ws.scale_ptr[1][local] = ws.scale_b + local * kb * a.n;
    return;
  }
  const int64_t first = ws.first_block[local];
  const bool rowwise = a.scaling == Fp8Scaling::rowwise;
  ws.scale_ptr[0][local] = (rowwise ? ws.scale_a : a.operands.a_scale) + first * a.k;
  ws.scale_ptr[1][local] = (rowwise ? ws.scale_b : a.operands.b_scale) + first * a.n;
}

// Weight gradient, after the first blocks: local group `local`'s GEMM in set kFp8GemmSet.
GG_HD void write_wgrad_group(const Fp8SetupArgs& a, const Fp8WorkspaceView& ws, int64_t local) {
  const GroupProblem p = fp8_wgrad_problem(workspace_rows(ws.base).group(local), ws.first_block[local], local,
                                           a.k, a.n, a.layout.aligned_tokens, a.accumulate);
  write_group(ws.base.gemm[kFp8GemmSet], local, p,
              GemmOperands{ws.operand_a, ws.operand_b, a.operands.d, a.operands.d, 1, 1, a.operands.d_bytes,
                           a.operands.d_bytes});
  write_scale_pointers(a, ws, local);
}

// ---- the element steps of the copy kernels (one thread per element on the GPU) -------

// Matmul lhs scale: the kernel's entry of block kb for `row` in the [Kb][M_g] block of the
// group owning it; -1 for a padding row (no entry).
GG_HD int64_t lhs_scale_slot(const WindowRows& rows, int64_t row, int64_t kb, int64_t kb_count) {
  const int64_t g = group_of_row(rows.boundary, rows.window, row);
  if (g < 0) return -1;
  const RowRange group = rows.group(g - rows.group_offset);
  return kb_count * group.begin + kb * group.rows() + (row - group.begin);
}

// The local group whose token blocks hold `block` (first_block[l] <= block <
// first_block[l + 1]: a group with blocks), or -1 past the last used block.
GG_HD int64_t group_of_block(const int64_t* first_block, int64_t num_groups, int64_t block) {
  if (block < 0 || block >= first_block[num_groups]) return -1;
  int64_t lo = 0, hi = num_groups;  // invariant: first_block[lo] <= block < first_block[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (first_block[mid] <= block)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// The rows of scale row `scale_row` of the grouped quantization: a local group's rows
// (rowwise), or the rows of one token block (blockwise); none for an unused block.
GG_HD RowRange scale_row_tokens(const WindowRows& rows, const int64_t* first_block, Fp8Scaling scaling,
                                int64_t num_groups, int64_t scale_row) {
  if (scaling == Fp8Scaling::rowwise) return rows.group(scale_row);
  const int64_t l = group_of_block(first_block, num_groups, scale_row);
  if (l < 0) return {0, 0};
  const RowRange group = rows.group(l);
  const int64_t begin = group.begin + (scale_row - first_block[l]) * kFp8Block;
  return {begin, begin + kFp8Block < group.end ? begin + kFp8Block : group.end};
}

// Weight gradient: the source token of aligned column `col`, or -1 where the copy holds
// a zero (a group's last block past its rows, or a block no group uses).
GG_HD int64_t aligned_source_token(const WindowRows& rows, const int64_t* first_block, int64_t num_groups,
                                   int64_t col) {
  const int64_t l = group_of_block(first_block, num_groups, col / kFp8Block);
  if (l < 0) return -1;
  const int64_t token = rows.group(l).begin + (col - first_block[l] * kFp8Block);
  return token < rows.group(l).end ? token : -1;
}

}  // namespace groupgemm
