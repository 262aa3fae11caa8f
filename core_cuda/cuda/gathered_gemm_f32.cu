// Gathered grouped GEMM instantiations for float32 inputs: exact fp32 on CUDA cores.
#include "cutlass_gathered.cuh"

namespace groupgemm {
namespace cuda {

Status gathered_gemm_f32(const GatheredGemmLaunch& launch) {
  return run_gathered_for_input<float, SimtF32Config, SimtF32Config>(launch);
}

}  // namespace cuda
}  // namespace groupgemm
