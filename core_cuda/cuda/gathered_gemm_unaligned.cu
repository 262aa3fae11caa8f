// The gathered grouped GEMM for 16-bit operands whose rows are not 16-byte aligned (H, F_in
// or F not a multiple of 8, or an odd base address), where tensor-core tiles cannot load: a
// plain shared-memory tiled kernel (gemm_unaligned.cu's, its operand reads going through
// the group's indices) with float32 accumulation in a fixed k order, so no shape is refused.
// Also the dispatch between it and the CUTLASS kernels.
#include "dtypes.cuh"
#include "gathered_gemm.h"
#include "kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

constexpr int kTile = 16;

// kGather a_rows: row_row or row_col; a_k and b_k: col_row.
template <typename In, typename Out, Gather kGather>
__global__ void __launch_bounds__(kTile* kTile)
    gathered_unaligned_kernel(GroupedGemmLaunch l, const int32_t* const* indices) {
  __shared__ float a_tile[kTile][kTile + 1];
  __shared__ float b_tile[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  constexpr bool a_col = kGather != Gather::a_rows;
  const bool b_col = l.layout == GemmLayout::row_col;
  for (int g = blockIdx.z; g < l.num_groups; g += gridDim.z) {
    const int m = l.problems[3 * g], n = l.problems[3 * g + 1], k = l.problems[3 * g + 2];
    const In* a = static_cast<const In*>(l.ptr[0][g]);
    const In* b = static_cast<const In*>(l.ptr[1][g]);
    const Out* c = static_cast<const Out*>(l.ptr[2][g]);
    Out* d = static_cast<Out*>(l.ptr[3][g]);
    const int32_t* index = indices[g];
    const int64_t lda = l.ld[0][g], ldb = l.ld[1][g], ldc = l.ld[2][g], ldd = l.ld[3][g];
    const int64_t col = int64_t(blockIdx.x) * kTile + tx;
    for (int64_t row0 = int64_t(blockIdx.y) * kTile; row0 < m; row0 += int64_t(gridDim.y) * kTile) {
      const int64_t row = row0 + ty;
      float acc = 0.0f;
      for (int64_t k0 = 0; k0 < k; k0 += kTile) {
        const int64_t ak = k0 + tx, bk = k0 + ty;
        float av = 0.0f, bv = 0.0f;
        if (row < m && ak < k) {
          const int64_t ar = kGather == Gather::a_rows ? index[row] : row;
          const int64_t ac = kGather == Gather::a_k ? index[ak] : ak;
          av = float(a[a_col ? ac * lda + ar : ar * lda + ac]);
        }
        if (bk < k && col < n) {
          const int64_t br = kGather == Gather::b_k ? index[bk] : bk;
          bv = float(b[b_col ? col * ldb + br : br * ldb + col]);
        }
        a_tile[ty][tx] = av;
        b_tile[ty][tx] = bv;
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

Status gathered_gemm_unaligned(const GatheredGemmLaunch& launch) {
  const GroupedGemmLaunch& l = launch.gemm;
  const dim3 grid(grid_dim(ceil_div(l.n, kTile), kMaxGridX), grid_dim(ceil_div(l.max_m, kTile), 1024),
                  grid_dim(l.num_groups, kMaxGridYZ));
  auto run = [&](auto in_tag, auto out_tag) {
    using In = decltype(in_tag);
    using Out = decltype(out_tag);
    const dim3 block(kTile, kTile);
    switch (launch.gather) {
      case Gather::a_rows:
        gathered_unaligned_kernel<In, Out, Gather::a_rows><<<grid, block, 0, l.stream>>>(l, launch.indices);
        break;
      case Gather::a_k:
        gathered_unaligned_kernel<In, Out, Gather::a_k><<<grid, block, 0, l.stream>>>(l, launch.indices);
        break;
      case Gather::b_k:
        gathered_unaligned_kernel<In, Out, Gather::b_k><<<grid, block, 0, l.stream>>>(l, launch.indices);
        break;
      case Gather::none: return Status::Internal("the gathered GEMM needs a gathered operand");
    }
    return last_launch("the unaligned gathered grouped GEMM");
  };
  // 16-bit inputs; the output in their dtype or float32 (fc2's input gradient).
  const bool wide = l.out_dtype == DType::f32;
  using bf16 = cutlass::bfloat16_t;
  using f16 = cutlass::half_t;
  if (l.in_dtype == DType::bf16) return wide ? run(bf16{}, float{}) : run(bf16{}, bf16{});
  if (l.in_dtype == DType::f16) return wide ? run(f16{}, float{}) : run(f16{}, f16{});
  return Status::Internal("the unaligned gathered GEMM takes 16-bit inputs");
}

Status gathered_gemm(const GatheredGemmLaunch& launch, bool aligned) {
  switch (launch.gemm.in_dtype) {
    case DType::f32: return gathered_gemm_f32(launch);
    case DType::bf16: return aligned ? gathered_gemm_bf16(launch) : gathered_gemm_unaligned(launch);
    case DType::f16: return aligned ? gathered_gemm_f16(launch) : gathered_gemm_unaligned(launch);
    default:
      return Status::Invalid(std::string(dtype_name(launch.gemm.in_dtype)) + " is not supported on CUDA");
  }
}

}  // namespace cuda
}  // namespace groupgemm
