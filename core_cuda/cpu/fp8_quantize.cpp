// The CPU backend's FP8 quantization: each block's amax, its scale and the float8 values
// by groupgemm/fp8_math.h's exact rules. Every block is independent (one thread computes
// all of it), so the bits do not depend on the thread count.
#include <algorithm>
#include <cstring>
#include <vector>

#include "convert.h"
#include "fp8_backends.h"
#include "fp8_groups.h"
#include "groupgemm/fp8_math.h"

namespace groupgemm {
namespace cpu {
namespace {

// Calls fn(const In*) with x as its float32, bfloat16 or float16 storage type.
template <typename Fn>
Status with_input(DType t, const void* x, Fn&& fn) {
  return visit_dtype(t, [&](auto tag) {
    using In = decltype(tag);
    fn(static_cast<const In*>(x));
    return Status::Ok();
  });
}

}  // namespace

Status quantize_rows(const QuantizeRowsArgs& a) {
  const bool rowwise = a.scaling == Fp8Scaling::rowwise;
  const int64_t blocks = rowwise ? 1 : fp8_blocks(a.cols);
  const int64_t width = rowwise ? a.cols : kFp8Block;
  auto* q = static_cast<uint8_t*>(a.q);
  return with_input(a.in_dtype, a.x, [&](const auto* x) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < a.rows; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t begin = r * a.cols + b * width, end = r * a.cols + std::min(a.cols, (b + 1) * width);
        float amax = 0.0f;
        for (int64_t i = begin; i < end; ++i) amax = amax_step(amax, widen(x[i]));
        const float s = fp8_scale(amax, a.out_type, a.power_of_two);
        a.scale[r * blocks + b] = s;
        for (int64_t i = begin; i < end; ++i) q[i] = quantize_value(widen(x[i]), s, a.out_type);
      }
    }
  });
}

Status quantize_blocks(const QuantizeBlocksArgs& a) {
  const int64_t row_blocks = fp8_blocks(a.rows), col_blocks = fp8_blocks(a.cols);
  const int64_t tiles = a.batch * row_blocks * col_blocks;
  auto* q = static_cast<uint8_t*>(a.q);
  return with_input(a.in_dtype, a.x, [&](const auto* x) {
#pragma omp parallel for schedule(static)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t b = tile / (row_blocks * col_blocks), rb = tile / col_blocks % row_blocks,
                    cb = tile % col_blocks;
      const int64_t r0 = rb * kFp8Block, r1 = std::min(a.rows, r0 + kFp8Block);
      const int64_t c0 = cb * kFp8Block, c1 = std::min(a.cols, c0 + kFp8Block);
      const int64_t base = b * a.rows * a.cols;
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = amax_step(amax, widen(x[base + r * a.cols + c]));
      const float s = fp8_scale(amax, a.out_type, a.power_of_two);
      a.scale[tile] = s;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          q[base + r * a.cols + c] = quantize_value(widen(x[base + r * a.cols + c]), s, a.out_type);
    }
  });
}

Status quantize_grouped(const QuantizeGroupedArgs& a) {
  const LocalGroups groups = local_groups(a.group_sizes, a.group_offset, a.num_groups, a.m);
  const int64_t scale_rows = token_scale_rows(a.scaling, a.m, a.num_groups);
  std::fill(a.scale, a.scale + scale_rows * a.cols, 1.0f);  // empty groups and unused blocks
  auto* q = static_cast<uint8_t*>(a.q);
  for (int64_t c = 0; c < a.cols && a.m > 0; ++c) {  // padding rows: exact zeros in q's columns
    std::memset(q + c * a.m, 0, groups.owned.begin);
    std::memset(q + c * a.m + groups.owned.end, 0, a.m - groups.owned.end);
  }
  // Every block of every group: its rows and its scale row.
  struct Block {
    RowRange rows;
    int64_t scale_row;
  };
  std::vector<Block> blocks;
  for (int64_t l = 0; l < a.num_groups; ++l) {
    const RowRange rows = groups.rows[l];
    const int64_t step = a.scaling == Fp8Scaling::rowwise ? std::max<int64_t>(rows.rows(), 1) : kFp8Block;
    for (int64_t begin = rows.begin; begin < rows.end; begin += step)
      blocks.push_back({{begin, std::min(rows.end, begin + step)},
                        token_block_of_row(a.scaling, l, groups.first_block[l], rows, begin)});
  }
  return with_input(a.in_dtype, a.x, [&](const auto* x) {
#pragma omp parallel
    {
      std::vector<float> amax(a.cols);
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < static_cast<int64_t>(blocks.size()); ++i) {
        const Block& blk = blocks[i];
        std::fill(amax.begin(), amax.end(), 0.0f);
        for (int64_t r = blk.rows.begin; r < blk.rows.end; ++r)
          for (int64_t c = 0; c < a.cols; ++c) amax[c] = amax_step(amax[c], widen(x[r * a.cols + c]));
        float* scale = a.scale + blk.scale_row * a.cols;
        for (int64_t c = 0; c < a.cols; ++c) scale[c] = fp8_scale(amax[c], a.out_type, a.power_of_two);
        for (int64_t r = blk.rows.begin; r < blk.rows.end; ++r)
          for (int64_t c = 0; c < a.cols; ++c)
            q[c * a.m + r] = quantize_value(widen(x[r * a.cols + c]), scale[c], a.out_type);
      }
    }
  });
}

}  // namespace cpu
}  // namespace groupgemm
