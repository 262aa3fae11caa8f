// The CUTLASS 2.x grouped GEMM's instantiations per input dtype (grouped_gemm.h): bfloat16
// and float16 on tensor cores (their own dtype or float32 output), float32 as exact fp32 on
// CUDA cores. One translation unit: the three share most of their compile (about 85 s of one
// core together, 135 s as three units).
#include "cutlass/bfloat16.h"
#include "cutlass/half.h"
#include "cutlass_grouped.cuh"

namespace groupgemm {
namespace cuda {

Status grouped_gemm_bf16(const GroupedGemmLaunch& launch) {
  return run_for_input<cutlass::bfloat16_t>(launch);
}

Status grouped_gemm_f16(const GroupedGemmLaunch& launch) {
  return run_for_input<cutlass::half_t>(launch);
}

Status grouped_gemm_f32(const GroupedGemmLaunch& launch) {
  return run_for_input<float>(launch);
}

}  // namespace cuda
}  // namespace groupgemm
