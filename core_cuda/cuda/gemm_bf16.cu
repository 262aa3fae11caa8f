// Grouped GEMM instantiations for bfloat16 inputs (bfloat16 or float32 output).
#include "cutlass/bfloat16.h"
#include "cutlass_grouped.cuh"

namespace groupgemm {
namespace cuda {

Status grouped_gemm_bf16(const GroupedGemmLaunch& launch) {
  using In = cutlass::bfloat16_t;
  return run_for_input<In, TensorOpConfig<In, float>, TensorOpConfig<In, In>>(launch);
}

}  // namespace cuda
}  // namespace groupgemm
