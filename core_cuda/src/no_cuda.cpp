// The CUDA backend's entry points in a build without nvcc: each reports that clearly.
#include "backends.h"

namespace groupgemm {
namespace cuda {
namespace {
Status not_built() {
  return Status::Unimplemented("groupgemm was built without CUDA; reinstall with nvcc available");
}
}  // namespace

Status grouped_matmul(const MatmulArgs&, const ExecContext&) { return not_built(); }
Status grouped_matmul_wgrad(const WgradArgs&, const ExecContext&) { return not_built(); }
Status grouped_bias_grad(const BiasGradArgs&, const ExecContext&) { return not_built(); }

}  // namespace cuda
}  // namespace groupgemm
