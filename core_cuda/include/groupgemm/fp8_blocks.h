// Where the scale blocks of the FP8 calls lie: contraction blocks of 128 (the forward
// and dgrad GEMMs' K), and the weight gradient's token blocks, which restart at every
// group's first row so that no block spans two experts. __host__ __device__, shared by
// the CPU backend and the CUDA setup kernels.
#pragma once

#include <cstdint>

#include "groupgemm/fp8.h"
#include "groupgemm/schedule.h"

namespace groupgemm {

// Blocks of 128 covering `length` elements (the last one may be partial).
GG_HD int64_t fp8_blocks(int64_t length) { return length > 0 ? ceil_div(length, kFp8Block) : 0; }

// The most token blocks num_groups groups of m rows in all can need: each group's
// ceil(rows / 128) summed is at most floor((m + 127 G) / 128). The blockwise weight
// gradient's scales have this many rows, whatever the group sizes on the device.
GG_HD int64_t token_block_bound(int64_t m, int64_t num_groups) {
  if (m <= 0 || num_groups <= 0) return 0;
  return (m + (kFp8Block - 1) * num_groups) / kFp8Block;
}

// The scale row of the weight gradient's token block holding `row` of a local group
// that owns `rows` and whose first block is `first_block`: rowwise, the group's own row
// `local`; blockwise, first_block + (row - rows.begin) / 128.
GG_HD int64_t token_block_of_row(Fp8Scaling scaling, int64_t local, int64_t first_block, RowRange rows,
                                 int64_t row) {
  return scaling == Fp8Scaling::rowwise ? local : first_block + (row - rows.begin) / kFp8Block;
}

// Scale rows the weight gradient's scales have: G (rowwise) or token_block_bound (blockwise).
GG_HD int64_t token_scale_rows(Fp8Scaling scaling, int64_t m, int64_t num_groups) {
  return scaling == Fp8Scaling::rowwise ? num_groups : token_block_bound(m, num_groups);
}

// The forward / dgrad scales of one contraction block kb (blocks of 128 along K):
//   rowwise   lhs_scale[row],           rhs_scale[g * n + col]
//   blockwise lhs_scale[row * kb_count + kb], rhs_scale[(g * ceil(n/128) + col / 128) * kb_count + kb]
GG_HD int64_t lhs_scale_index(Fp8Scaling scaling, int64_t row, int64_t kb, int64_t kb_count) {
  return scaling == Fp8Scaling::rowwise ? row : row * kb_count + kb;
}

GG_HD int64_t rhs_scale_index(Fp8Scaling scaling, int64_t g, int64_t col, int64_t n, int64_t kb,
                              int64_t kb_count) {
  return scaling == Fp8Scaling::rowwise ? g * n + col : (g * fp8_blocks(n) + col / kFp8Block) * kb_count + kb;
}

// The scale arrays' element counts, which both frameworks' bindings check (the core gets
// pointers only):
//  - a token-major operand of rows x cols quantized along cols (the forward's lhs, the
//    rows quantization): rowwise one per row, blockwise one per row and 128 columns;
//  - a weight [G, n, k] (the forward's rhs): rowwise one per output column, blockwise one
//    per 128 x 128 block;
//  - a 3-D blocks quantization of batch x rows x cols: one per 128 x 128 block.
GG_HD int64_t row_scale_count(Fp8Scaling scaling, int64_t rows, int64_t cols) {
  return scaling == Fp8Scaling::rowwise ? rows : rows * fp8_blocks(cols);
}
GG_HD int64_t weight_scale_count(Fp8Scaling scaling, int64_t num_groups, int64_t n, int64_t k) {
  return scaling == Fp8Scaling::rowwise ? num_groups * n : num_groups * fp8_blocks(n) * fp8_blocks(k);
}
GG_HD int64_t block_scale_count(int64_t batch, int64_t rows, int64_t cols) {
  return batch * fp8_blocks(rows) * fp8_blocks(cols);
}

}  // namespace groupgemm
