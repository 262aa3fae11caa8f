// The CUTLASS 2.x gathered grouped GEMM's instantiations per input dtype (gathered_gemm.h):
// A's rows gathered with either forward layout (the inputs' dtype or float32 output), a
// weight gradient's contraction gathered in A or in B (the inputs' dtype); bfloat16 and
// float16 on tensor cores, float32 as exact fp32 on CUDA cores. One translation unit, as in
// grouped_gemm_instances.cu.
#include "cutlass/bfloat16.h"
#include "cutlass/half.h"
#include "cutlass_gathered.cuh"

namespace groupgemm {
namespace cuda {

Status gathered_gemm_bf16(const GatheredGemmLaunch& launch) {
  return run_gathered_for_input<cutlass::bfloat16_t>(launch);
}

Status gathered_gemm_f16(const GatheredGemmLaunch& launch) {
  return run_gathered_for_input<cutlass::half_t>(launch);
}

Status gathered_gemm_f32(const GatheredGemmLaunch& launch) {
  return run_gathered_for_input<float>(launch);
}

}  // namespace cuda
}  // namespace groupgemm
