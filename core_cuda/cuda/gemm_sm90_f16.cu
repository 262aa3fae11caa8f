// sm_90a grouped GEMM instantiations for float16 inputs (float16 or float32 output).
#include "cutlass/half.h"
#include "cutlass_sm90.cuh"

namespace groupgemm {
namespace cuda {

Status grouped_gemm_sm90_f16(const Sm90Launch& launch) { return run_sm90_for_input<cutlass::half_t>(launch); }

size_t sm90_workspace_bytes_f16(int sm_count) {
  return sm90_workspace_bytes_for_input<cutlass::half_t>(sm_count);
}

}  // namespace cuda
}  // namespace groupgemm
