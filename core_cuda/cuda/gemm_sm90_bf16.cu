// sm_90a grouped GEMM instantiations for bfloat16 inputs (bfloat16 or float32 output).
#include "cutlass/bfloat16.h"
#include "cutlass_sm90.cuh"

namespace groupgemm {
namespace cuda {

Status grouped_gemm_sm90_bf16(const Sm90Launch& launch) {
  return run_sm90_for_input<cutlass::bfloat16_t>(launch);
}

size_t sm90_workspace_bytes_bf16(int sm_count) {
  return sm90_workspace_bytes_for_input<cutlass::bfloat16_t>(sm_count);
}

}  // namespace cuda
}  // namespace groupgemm
