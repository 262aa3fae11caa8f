// Gathered grouped GEMM instantiations for bfloat16 inputs: A's rows gathered with either
// forward layout (bfloat16 or float32 output), a weight gradient's contraction gathered in A
// or in B (bfloat16 output).
#include "cutlass/bfloat16.h"
#include "cutlass_gathered.cuh"

namespace groupgemm {
namespace cuda {

Status gathered_gemm_bf16(const GatheredGemmLaunch& launch) {
  using In = cutlass::bfloat16_t;
  return run_gathered_for_input<In, TensorOpConfig<In, float>, TensorOpConfig<In, In>>(launch);
}

}  // namespace cuda
}  // namespace groupgemm
