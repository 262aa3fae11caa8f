// The FP8 quantization kernels. Each thread block owns whole scale blocks: it reduces the
// block's amax (amax_step is associative and commutative, so the tree order gives the CPU
// loop's bits), takes fp8_math.h's scale and writes the float8 values, the same bits as
// the CPU backend (IEEE division, no fast-math). Plain CUDA: any GPU runs them.
#include <cub/block/block_reduce.cuh>

#include "dtypes.cuh"
#include "fp8_kernels.h"
#include "groupgemm/fp8_math.h"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

constexpr int kQuantizeThreads = 128;

struct AmaxOp {
  __device__ float operator()(float a, float b) const { return amax_step(a, b); }
};

// The block's amax over the values its threads saw, broadcast to every thread.
__device__ float block_amax(float mine) {
  using Reduce = cub::BlockReduce<float, kQuantizeThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ float amax;
  const float all = Reduce(storage).Reduce(mine, AmaxOp{});
  if (threadIdx.x == 0) amax = all;
  __syncthreads();
  const float result = amax;
  __syncthreads();  // storage and amax are reused by the next block of the loop
  return result;
}

// Rows: one scale block (a row's 128-wide tile, or the whole row) per thread block.
template <typename In>
__global__ void quantize_rows_kernel(QuantizeRowsArgs a) {
  const In* x = static_cast<const In*>(a.x);
  auto* q = static_cast<uint8_t*>(a.q);
  const bool rowwise = a.scaling == Fp8Scaling::rowwise;
  const int64_t blocks = rowwise ? 1 : fp8_blocks(a.cols), width = rowwise ? a.cols : kFp8Block;
  for (int64_t sb = blockIdx.x; sb < a.rows * blocks; sb += gridDim.x) {
    const int64_t r = sb / blocks, b = sb % blocks;
    const int64_t begin = r * a.cols + b * width, end = r * a.cols + min(a.cols, (b + 1) * width);
    float amax = 0.0f;
    for (int64_t i = begin + threadIdx.x; i < end; i += kQuantizeThreads) amax = amax_step(amax, float(x[i]));
    const float s = fp8_scale(block_amax(amax), a.out_type, a.power_of_two);
    if (threadIdx.x == 0) a.scale[sb] = s;
    for (int64_t i = begin + threadIdx.x; i < end; i += kQuantizeThreads)
      q[i] = quantize_value(float(x[i]), s, a.out_type);
  }
}

// 128 x 128 blocks: one per thread block.
template <typename In>
__global__ void quantize_blocks_kernel(QuantizeBlocksArgs a) {
  const In* x = static_cast<const In*>(a.x);
  auto* q = static_cast<uint8_t*>(a.q);
  const int64_t row_blocks = fp8_blocks(a.rows), col_blocks = fp8_blocks(a.cols);
  for (int64_t tile = blockIdx.x; tile < a.batch * row_blocks * col_blocks; tile += gridDim.x) {
    const int64_t b = tile / (row_blocks * col_blocks), rb = tile / col_blocks % row_blocks,
                  cb = tile % col_blocks;
    const int64_t r0 = rb * kFp8Block, rows = min(a.rows, r0 + kFp8Block) - r0;
    const int64_t c0 = cb * kFp8Block, cols = min(a.cols, c0 + kFp8Block) - c0;
    const int64_t base = b * a.rows * a.cols + r0 * a.cols + c0;
    float amax = 0.0f;
    for (int64_t i = threadIdx.x; i < rows * cols; i += kQuantizeThreads)
      amax = amax_step(amax, float(x[base + i / cols * a.cols + i % cols]));
    const float s = fp8_scale(block_amax(amax), a.out_type, a.power_of_two);
    if (threadIdx.x == 0) a.scale[tile] = s;
    for (int64_t i = threadIdx.x; i < rows * cols; i += kQuantizeThreads) {
      const int64_t at = base + i / cols * a.cols + i % cols;
      q[at] = quantize_value(float(x[at]), s, a.out_type);
    }
  }
}

// Grouped, transposed: one scale row (a group, or a token block) per thread block, its
// threads over the channels; rows of no block (padding) are zeros in q (the padding
// kernel), scale rows of no block (empty groups, unused blocks) 1.
template <typename In>
__global__ void quantize_grouped_kernel(QuantizeGroupedArgs a, Fp8SetupArgs s) {
  const Fp8WorkspaceView ws = fp8_view(s);
  const WindowRows rows = workspace_rows(ws.base);
  const In* x = static_cast<const In*>(a.x);
  auto* q = static_cast<uint8_t*>(a.q);
  const int64_t scale_rows = token_scale_rows(a.scaling, a.m, a.num_groups);
  for (int64_t sr = blockIdx.x; sr < scale_rows; sr += gridDim.x) {
    const RowRange tokens = scale_row_tokens(rows, ws.first_block, a.scaling, a.num_groups, sr);
    for (int64_t c = threadIdx.x; c < a.cols; c += kQuantizeThreads) {
      float amax = 0.0f;
      for (int64_t r = tokens.begin; r < tokens.end; ++r) amax = amax_step(amax, float(x[r * a.cols + c]));
      const float scale = fp8_scale(amax, a.out_type, a.power_of_two);
      a.scale[sr * a.cols + c] = scale;
      for (int64_t r = tokens.begin; r < tokens.end; ++r)
        q[c * a.m + r] = quantize_value(float(x[r * a.cols + c]), scale, a.out_type);
    }
  }
}

__global__ void zero_padding_columns_kernel(QuantizeGroupedArgs a, Fp8SetupArgs s) {
  const RowRange owned = workspace_rows(fp8_view(s).base).owned();
  const int64_t padding = a.m - owned.rows();
  auto* q = static_cast<uint8_t*>(a.q);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < a.cols * padding;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = i / padding, p = i % padding;
    q[c * a.m + (p < owned.begin ? p : owned.end + (p - owned.begin))] = 0;
  }
}

unsigned scale_blocks_grid(int64_t blocks) { return grid_dim(blocks, 65535); }

}  // namespace

Status launch_fp8_quantize_rows(const QuantizeRowsArgs& a, cudaStream_t stream) {
  const int64_t blocks = a.rows * (a.scaling == Fp8Scaling::rowwise ? 1 : fp8_blocks(a.cols));
  if (blocks == 0) return Status::Ok();
  return visit_cuda_dtype(a.in_dtype, [&](auto tag) {
    quantize_rows_kernel<decltype(tag)><<<scale_blocks_grid(blocks), kQuantizeThreads, 0, stream>>>(a);
    return last_launch("the FP8 row quantization kernel");
  });
}

Status launch_fp8_quantize_blocks(const QuantizeBlocksArgs& a, cudaStream_t stream) {
  const int64_t tiles = a.batch * fp8_blocks(a.rows) * fp8_blocks(a.cols);
  if (tiles == 0) return Status::Ok();
  return visit_cuda_dtype(a.in_dtype, [&](auto tag) {
    quantize_blocks_kernel<decltype(tag)><<<scale_blocks_grid(tiles), kQuantizeThreads, 0, stream>>>(a);
    return last_launch("the FP8 block quantization kernel");
  });
}

Status launch_fp8_quantize_grouped(const QuantizeGroupedArgs& a, const Fp8SetupArgs& s, cudaStream_t stream) {
  if (a.cols == 0) return Status::Ok();
  if (a.m > 0) {
    zero_padding_columns_kernel<<<grid_dim(ceil_div(a.cols * a.m, kThreads), 65535), kThreads, 0, stream>>>(
        a, s);
    GG_RETURN_IF_ERROR(last_launch("the FP8 padding zeroing kernel"));
  }
  const int64_t scale_rows = token_scale_rows(a.scaling, a.m, a.num_groups);
  if (scale_rows == 0) return Status::Ok();
  return visit_cuda_dtype(a.in_dtype, [&](auto tag) {
    quantize_grouped_kernel<decltype(tag)>
        <<<scale_blocks_grid(scale_rows), kQuantizeThreads, 0, stream>>>(a, s);
    return last_launch("the FP8 grouped quantization kernel");
  });
}

}  // namespace cuda
}  // namespace groupgemm
