// Gathered grouped GEMM instantiations for float16 inputs: A's rows gathered with either
// forward layout (float16 or float32 output), a weight gradient's contraction gathered in A
// or in B (float16 output).
#include "cutlass/half.h"
#include "cutlass_gathered.cuh"

namespace groupgemm {
namespace cuda {

Status gathered_gemm_f16(const GatheredGemmLaunch& launch) {
  using In = cutlass::half_t;
  return run_gathered_for_input<In, TensorOpConfig<In, float>, TensorOpConfig<In, In>>(launch);
}

}  // namespace cuda
}  // namespace groupgemm
