// Grouped GEMM instantiations for float16 inputs (float16 or float32 output).
#include "cutlass/half.h"
#include "cutlass_grouped.cuh"

namespace groupgemm {
namespace cuda {

Status grouped_gemm_f16(const GroupedGemmLaunch& launch) {
  using In = cutlass::half_t;
  return run_for_input<In, TensorOpConfig<In, float>, TensorOpConfig<In, In>>(launch);
}

}  // namespace cuda
}  // namespace groupgemm
