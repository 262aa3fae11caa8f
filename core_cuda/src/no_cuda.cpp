// The CUDA backend's entry points in a build without nvcc: each reports that clearly.
#include "backends.h"
#include "fp8_backends.h"

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
Status grouped_matmul_backward(const BackwardArgs&, const ExecContext&) { return not_built(); }
int64_t grouped_matmul_kernel_workspace_bytes(int) { return 0; }
Status permute(const PermuteArgs&, const ExecContext&) { return not_built(); }
Status unpermute(const UnpermuteArgs&, const ExecContext&) { return not_built(); }
Status unpermute_backward(const UnpermuteBackwardArgs&, const ExecContext&) { return not_built(); }
Status activation(const ActivationArgs&, const ExecContext&) { return not_built(); }
Status activation_backward(const ActivationBackwardArgs&, const ExecContext&) { return not_built(); }
Status softmax_topk(const SoftmaxTopkArgs&, const ExecContext&) { return not_built(); }
Status softmax_topk_backward(const SoftmaxTopkBackwardArgs&, const ExecContext&) { return not_built(); }
Status softmax_topk_tangent(const SoftmaxTopkTangentArgs&, const ExecContext&) { return not_built(); }
Status expert_mlp(const ExpertMlpArgs&, const ExecContext&) { return not_built(); }
Status expert_mlp_backward(const ExpertMlpBackwardArgs&, const ExecContext&) { return not_built(); }
CaptureRecord capture_record() { return {}; }
Status quantize_rows(const QuantizeRowsArgs&, const ExecContext&) { return not_built(); }
Status quantize_blocks(const QuantizeBlocksArgs&, const ExecContext&) { return not_built(); }
Status quantize_grouped(const QuantizeGroupedArgs&, const ExecContext&) { return not_built(); }
Status scaled_grouped_matmul(const ScaledMatmulArgs&, const ExecContext&) { return not_built(); }
Status scaled_grouped_matmul_wgrad(const ScaledWgradArgs&, const ExecContext&) { return not_built(); }
int64_t fp8_kernel_workspace_bytes(int) { return 0; }

}  // namespace cuda
}  // namespace groupgemm
