// The CUDA backend's FP8 entry points in a build without nvcc: each reports that clearly.
#include "fp8_backends.h"

namespace groupgemm {
namespace cuda {
namespace {
Status not_built() {
  return Status::Unimplemented("groupgemm was built without CUDA; reinstall with nvcc available");
}
}  // namespace

Status quantize_rows(const QuantizeRowsArgs&, const ExecContext&) { return not_built(); }
Status quantize_blocks(const QuantizeBlocksArgs&, const ExecContext&) { return not_built(); }
Status quantize_grouped(const QuantizeGroupedArgs&, const ExecContext&) { return not_built(); }
Status scaled_grouped_matmul(const ScaledMatmulArgs&, const ExecContext&) { return not_built(); }
Status scaled_grouped_matmul_wgrad(const ScaledWgradArgs&, const ExecContext&) { return not_built(); }
int64_t fp8_kernel_workspace_bytes(int) { return 0; }

}  // namespace cuda
}  // namespace groupgemm
