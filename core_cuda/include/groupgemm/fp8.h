// The FP8 API of the core: scaled grouped GEMMs of float8 operands with float32 scales
// and the quantization that makes those operands, with the grouped GEMMs' contract
// (group sizes read on the device, empty groups and padding rows exact zeros).
//
// Scale layouts (all float32, row-major, "blocks" of 128 along the contraction):
//   rowwise   forward / dgrad: lhs_scale [M], rhs_scale [G, N] (one scale per row of
//             lhs, per output channel of rhs[g]);
//             weight gradient: lhs_scale [G, K], rhs_scale [G, N] (one scale per (group,
//             channel) over that group's tokens);
//   blockwise forward / dgrad: lhs_scale [M, ceil(K/128)] (1 x 128 tiles),
//             rhs_scale [G, ceil(N/128), ceil(K/128)] (128 x 128 blocks): DeepSeek-V3's;
//             weight gradient: lhs_scale [B, K], rhs_scale [B, N], B = token_block_bound(M, G):
//             128 tokens x 1 channel, the token blocks restarting at every group's first
//             row, so no block spans two experts (fp8_blocks.h numbers them).
// The operands are K-major as FP8 tensor cores read them: rhs is [G, N, K]; the weight
// gradient's operands are [K, M] and [N, M], the tokens contiguous.
#pragma once

#include <cstdint>

#include "groupgemm/types.h"

namespace groupgemm {

// The float8 formats, one row each: enum name, the name messages use (torch's and
// ml_dtypes'), exponent bias, mantissa bits, the largest finite value and its bits.
#define GROUPGEMM_FP8_TYPES(X)                 \
  X(e4m3, "float8_e4m3fn", 7, 3, 448.0f, 0x7e) \
  X(e5m2, "float8_e5m2", 15, 2, 57344.0f, 0x7b)

enum class Fp8Type : int {
#define GG_FP8_ENUMERATOR(id, name, bias, mantissa, max_value, max_bits) id,
  GROUPGEMM_FP8_TYPES(GG_FP8_ENUMERATOR)
#undef GG_FP8_ENUMERATOR
};

inline const char* fp8_name(Fp8Type t) {
  switch (t) {
#define GG_FP8_NAME(id, name, bias, mantissa, max_value, max_bits) \
  case Fp8Type::id: return name;
    GROUPGEMM_FP8_TYPES(GG_FP8_NAME)
#undef GG_FP8_NAME
  }
  return "unknown";
}

// How scales are laid over an operand: one per row (channel), or per 128-long block.
enum class Fp8Scaling : int { rowwise = 0, blockwise = 1 };

// The contraction block: the blockwise tiles' length, and how often the accumulation is
// rescaled (and, on tensor cores, promoted to float32).
constexpr int64_t kFp8Block = 128;

// ---- quantization: high-precision x -> (float8 q, float32 scales) --------------------
// For every block: amax = max |x| over it, scale = amax / max_finite(out_type) (1 when
// amax is 0, at least 2^-126, rounded up to a power of two when power_of_two), and
// q = x / scale rounded to nearest even, saturated to +-max_finite. Zeros stay exact
// zeros; a NaN makes its block's scale NaN. fp8_math.h holds the exact rules.

// x [R, C] -> q [R, C]; scale [R] (rowwise: one per row) or [R, ceil(C/128)] (blockwise:
// 1 x 128 tiles). Activations of the forward and dgrad GEMMs; rowwise weights as
// [G * N, K] rows.
struct QuantizeRowsArgs {
  DType in_dtype = DType::f32;  // float32, bfloat16 or float16
  Fp8Type out_type = Fp8Type::e4m3;
  Fp8Scaling scaling = Fp8Scaling::rowwise;
  bool power_of_two = false;
  const void* x = nullptr;
  void* q = nullptr;
  float* scale = nullptr;
  int64_t rows = 0, cols = 0;
};

// w [B, R, C] -> q [B, R, C]; scale [B, ceil(R/128), ceil(C/128)]: 128 x 128 blocks
// (the weights of the blockwise recipe; the same blocks transposed serve the dgrad).
struct QuantizeBlocksArgs {
  DType in_dtype = DType::f32;
  Fp8Type out_type = Fp8Type::e4m3;
  bool power_of_two = false;
  const void* x = nullptr;
  void* q = nullptr;
  float* scale = nullptr;
  int64_t batch = 0, rows = 0, cols = 0;
};

// The weight gradient's operands: x [M, C] (tokens sorted by group) -> q [C, M], the
// transpose, with scales per (group, channel) [G, C] (rowwise) or per (token block,
// channel) [token_block_bound(M, G), C] (blockwise). Rows owned by no local group come
// out as exact zeros in q; scale rows of empty groups or unused blocks are 1.
struct QuantizeGroupedArgs {
  DType in_dtype = DType::f32;
  Fp8Type out_type = Fp8Type::e4m3;
  Fp8Scaling scaling = Fp8Scaling::rowwise;
  bool power_of_two = false;
  const void* x = nullptr;  // [M, C]
  void* q = nullptr;        // [C, M]
  float* scale = nullptr;
  int64_t m = 0, cols = 0;
  int64_t num_groups = 0;
  IndexArray group_sizes;
  IndexArray group_offset;
};

// ---- scaled grouped GEMMs ----------------------------------------------------------

// out[r] = (lhs[r] @ rhs[g]^T) with the scales applied per 128-block of K, for the rows r
// of local group g (+ bias[g]); padding rows are exactly 0. lhs [M, K], rhs [G, N, K].
// Each block's float32 partial sum (products of float8 values are exact in float32, added
// in ascending k) is multiplied by lhs_scale * rhs_scale and added to the float32
// accumulator (a fused multiply-add), blocks in ascending order; out = accumulator + bias,
// rounded once. Blockwise needs K to be a multiple of 128.
struct ScaledMatmulArgs {
  Fp8Type lhs_type = Fp8Type::e4m3;  // e4m3, or e5m2 (a gradient)
  Fp8Type rhs_type = Fp8Type::e4m3;  // e4m3
  Fp8Scaling scaling = Fp8Scaling::rowwise;
  DType out_dtype = DType::bf16;  // bfloat16 or float32; bias has this dtype
  const void* lhs = nullptr;
  const void* rhs = nullptr;
  const float* lhs_scale = nullptr;
  const float* rhs_scale = nullptr;
  const void* bias = nullptr;  // [G, N], or null
  void* out = nullptr;         // [M, N]
  int64_t m = 0, k = 0, n = 0;
  int64_t num_groups = 0;
  IndexArray group_sizes;
  IndexArray group_offset;
};

// out[g] (=|+=) lhs[:, rows_g] @ rhs[:, rows_g]^T, contracting over group g's tokens in
// blocks of 128 that restart at the group's first row; lhs [K, M], rhs [N, M], out
// [G, K, N]. Each block's partial sum is scaled and accumulated as in ScaledMatmulArgs.
// An empty group gives exact zeros, or leaves out[g] bit-for-bit unchanged when
// accumulating into a float32 out.
struct ScaledWgradArgs {
  Fp8Type lhs_type = Fp8Type::e4m3;
  Fp8Type rhs_type = Fp8Type::e4m3;
  Fp8Scaling scaling = Fp8Scaling::rowwise;
  DType out_dtype = DType::bf16;  // bfloat16 or float32 (float32 when accumulating)
  const void* lhs = nullptr;
  const void* rhs = nullptr;
  const float* lhs_scale = nullptr;
  const float* rhs_scale = nullptr;
  void* out = nullptr;
  int64_t m = 0, k = 0, n = 0;
  int64_t num_groups = 0;
  bool accumulate = false;
  IndexArray group_sizes;
  IndexArray group_offset;
};

Status quantize_rows(const QuantizeRowsArgs& args, const ExecContext& ctx);
Status quantize_blocks(const QuantizeBlocksArgs& args, const ExecContext& ctx);
Status quantize_grouped(const QuantizeGroupedArgs& args, const ExecContext& ctx);
Status scaled_grouped_matmul(const ScaledMatmulArgs& args, const ExecContext& ctx);
Status scaled_grouped_matmul_wgrad(const ScaledWgradArgs& args, const ExecContext& ctx);

// Bytes of workspace each entry point needs (0 on the CPU). On CUDA the scaled GEMMs
// lay their scales out for the tensor cores and the weight gradient copies its operands
// into 128-token-aligned blocks, so the size depends on the shapes:
//   scaled_grouped_matmul:       (m, k, n) of the call
//   scaled_grouped_matmul_wgrad: (m, k, n) of the call (lhs [k, m], rhs [n, m])
//   quantize_grouped:            (m, 0, 0)
// device_index as for grouped_matmul_workspace_bytes.
enum class Fp8Call : int { matmul = 0, wgrad = 1, quantize_grouped = 2 };
int64_t fp8_workspace_bytes(Device device, Fp8Call call, Fp8Scaling scaling, int64_t num_groups, int64_t m,
                            int64_t k, int64_t n, int device_index = -1);

}  // namespace groupgemm
