// The GEMM stage of the CUDA backend: one grouped GEMM over the problems, pointers and
// leading dimensions that the setup kernel wrote into the workspace. Plain host header
// (no CUTLASS), so the entry points and the CUTLASS translation units share it.
#pragma once

#include <cuda_runtime.h>

#include "gemm_call.h"
#include "device_info.h"
#include "groupgemm/types.h"

namespace groupgemm {
namespace cuda {

// A GroupedGemmCall (gemm_call.h) with its GEMM set's device arrays, the device and
// the stream.
struct GroupedGemmLaunch {
  DType in_dtype;
  DType out_dtype;  // D, and C unless c == none
  GemmLayout layout;
  const int32_t* problems;  // device GemmCoord[num_groups]; 0 x 0 x 0 for skipped groups
  int num_groups;
  void** ptr[4];   // device arrays: A, B, C, D per group
  int64_t* ld[4];  // device arrays: lda, ldb, ldc, ldd per group
  GemmC c;         // none: D = A B;  otherwise D = A B + C (bias row, or D itself)
  int max_m;       // bound on any group's m (grid size of the fallback kernel)
  int n;           // every group's n
  DeviceInfo device;
  cudaStream_t stream;

  float beta() const { return c == GemmC::none ? 0.0f : 1.0f; }
};

// 16-bit inputs run on tensor cores when every group's operands are 16-byte aligned
// (aligned == true); otherwise, and for misaligned shapes, a plain tiled kernel runs.
// float32 runs exact fp32 FMA (no TF32) at any alignment.
Status grouped_gemm(const GroupedGemmLaunch& launch, bool aligned);

// Per input dtype (grouped_gemm_instances.cu), and the plain tiled kernel.
Status grouped_gemm_bf16(const GroupedGemmLaunch& launch);
Status grouped_gemm_f16(const GroupedGemmLaunch& launch);
Status grouped_gemm_f32(const GroupedGemmLaunch& launch);
Status grouped_gemm_unaligned(const GroupedGemmLaunch& launch);

}  // namespace cuda
}  // namespace groupgemm
