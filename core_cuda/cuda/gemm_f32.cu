// Grouped GEMM instantiations for float32 inputs: exact fp32 on CUDA cores.
#include "cutlass_grouped.cuh"

namespace groupgemm {
namespace cuda {

Status grouped_gemm_f32(const GroupedGemmLaunch& launch) {
  return run_for_input<float, SimtF32Config, SimtF32Config>(launch);
}

}  // namespace cuda
}  // namespace groupgemm
