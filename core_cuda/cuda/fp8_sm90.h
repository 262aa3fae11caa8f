// The sm_90a FP8 grouped GEMM stage (CUTLASS 3.x, fp8_sm90.cuh): what it reads from the
// FP8 workspace (fp8_workspace.h). Plain host header, so fp8_backend.cu needs no CUTLASS
// header.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "device_info.h"
#include "groupgemm/fp8.h"

namespace groupgemm {
namespace cuda {

// One grouped GEMM over the workspace's problems (its GEMM set kFp8GemmSet, and the scale
// pointers beside it): D[g] = sum over 128-blocks of K of
// (A[g] B[g]^T over the block) * SFA * SFB, + beta * C[g] (C is D: its bias rows, or the
// float32 sums it accumulates into). A is row-major [m, k] (K-major), B is [n, k]
// (K-major), D row-major; SFA per group [k / 128][m] and SFB [k / 128][n], one scale per
// row of A and per row of B (column of D) and block.
struct Fp8GemmLaunch {
  Fp8Type lhs_type;  // A: e4m3 or e5m2; B is e4m3
  DType out_dtype;   // C and D: bfloat16 or float32
  int num_groups;
  const int32_t* problems;  // int32 (m, n, k) per group, in device memory
  void** ptr[4];            // A, B, C, D per group, in device memory
  const float** scale[2];   // SFA, SFB per group, in device memory
  int64_t* ld[4];           // lda, ldb, ldc, ldd per group, in device memory
  float beta;
  DeviceInfo device;       // its SM count sizes the persistent grid
  void* kernel_workspace;  // CUTLASS's own (TMA descriptors), 128-byte aligned
  size_t kernel_workspace_bytes;
  cudaStream_t stream;
};

// Whether this build holds the sm_90a FP8 kernels (the architectures include 90a).
bool fp8_sm90_built();

// Runs the instantiation for the launch's (lhs type, output dtype).
Status fp8_grouped_gemm_sm90(const Fp8GemmLaunch& launch);

// CUTLASS's own workspace of the largest instantiation on a device with `sm_count` SMs.
size_t fp8_sm90_workspace_bytes(int sm_count);

// One instantiation per A type and output dtype, all in fp8_sm90_instances.cu, compiled for
// sm_90a only.
template <Fp8Type Lhs, DType Out>
Status fp8_grouped_gemm_sm90_for(const Fp8GemmLaunch& launch);
template <Fp8Type Lhs, DType Out>
size_t fp8_sm90_workspace_bytes_for(int sm_count);

}  // namespace cuda
}  // namespace groupgemm
