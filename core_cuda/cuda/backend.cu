// CUDA backend. The device kernels (setup kernel + CUTLASS grouped GEMM) are not built
// yet: every entry point reports that clearly instead of touching device memory.
#include "groupgemm/backends.h"
#include "groupgemm/schedule.h"

namespace groupgemm {
namespace cuda {
namespace {
Status not_implemented(const char* what) {
  return Status::Unimplemented(std::string(what) + " is not implemented on CUDA yet; use CPU tensors");
}
}  // namespace

Status grouped_matmul(const MatmulArgs&, const ExecContext&) { return not_implemented("grouped_matmul"); }
Status grouped_matmul_wgrad(const WgradArgs&, const ExecContext&) {
  return not_implemented("grouped_matmul_wgrad");
}
Status grouped_bias_grad(const BiasGradArgs&, const ExecContext&) {
  return not_implemented("grouped_bias_grad");
}
int64_t workspace_bytes(int64_t, int64_t) { return 0; }

}  // namespace cuda
}  // namespace groupgemm
