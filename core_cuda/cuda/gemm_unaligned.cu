// The grouped GEMM for 16-bit operands that are not 16-byte aligned (K or N not a
// multiple of 8, or an odd base address), where tensor-core tiles cannot load. A plain
// shared-memory tiled kernel with float32 accumulation in a fixed k order: slow but exact
// for every shape, so no shape is refused on CUDA.
#include "dtypes.cuh"
#include "grouped_gemm.h"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

constexpr int kTile = 16;

template <typename In, typename Out>
__global__ void __launch_bounds__(kTile* kTile)
    unaligned_gemm_kernel(GroupedGemmLaunch l, bool a_col, bool b_col) {
  __shared__ float a_tile[kTile][kTile + 1];
  __shared__ float b_tile[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int g = blockIdx.z; g < l.num_groups; g += gridDim.z) {
    const int m = l.problems[3 * g], n = l.problems[3 * g + 1], k = l.problems[3 * g + 2];
    const In* a = static_cast<const In*>(l.ptr[0][g]);
    const In* b = static_cast<const In*>(l.ptr[1][g]);
    const Out* c = static_cast<const Out*>(l.ptr[2][g]);
    Out* d = static_cast<Out*>(l.ptr[3][g]);
    const int64_t lda = l.ld[0][g], ldb = l.ld[1][g], ldc = l.ld[2][g], ldd = l.ld[3][g];
    const int64_t col = int64_t(blockIdx.x) * kTile + tx;
    for (int64_t row0 = int64_t(blockIdx.y) * kTile; row0 < m; row0 += int64_t(gridDim.y) * kTile) {
      const int64_t row = row0 + ty;
      float acc = 0.0f;
      for (int64_t k0 = 0; k0 < k; k0 += kTile) {
        const int64_t ar = row, ak = k0 + tx, bk = k0 + ty, bc = col;
        a_tile[ty][tx] = (ar < m && ak < k) ? float(a[a_col ? ak * lda + ar : ar * lda + ak]) : 0.0f;
        b_tile[ty][tx] = (bk < k && bc < n) ? float(b[b_col ? bc * ldb + bk : bk * ldb + bc]) : 0.0f;
        __syncthreads();
        for (int i = 0; i < kTile; ++i) acc = fmaf(a_tile[ty][i], b_tile[i][tx], acc);
        __syncthreads();
      }
      if (row < m && col < n) {
        const float source = l.c != GemmC::none ? float(c[row * ldc + col]) : 0.0f;
        d[row * ldd + col] = Out(acc + source);
      }
    }
  }
}

}  // namespace

Status grouped_gemm_unaligned(const GroupedGemmLaunch& l) {
  const bool a_col = l.layout == GemmLayout::col_row;
  const bool b_col = l.layout == GemmLayout::row_col;
  const dim3 grid(grid_dim(ceil_div(l.n, kTile), kMaxGridX), grid_dim(ceil_div(l.max_m, kTile), 1024),
                  grid_dim(l.num_groups, kMaxGridYZ));
  return visit_cuda_dtypes(l.in_dtype, l.out_dtype, [&](auto in_tag, auto out_tag) {
    using In = decltype(in_tag);
    using Out = decltype(out_tag);
    unaligned_gemm_kernel<In, Out><<<grid, dim3(kTile, kTile), 0, l.stream>>>(l, a_col, b_col);
    return last_launch("the unaligned grouped GEMM");
  });
}

}  // namespace cuda
}  // namespace groupgemm
