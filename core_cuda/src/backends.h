// Backend entry points behind the core API. Arguments arrive already validated.
#pragma once

#include "groupgemm/types.h"

namespace groupgemm {
namespace cpu {
Status grouped_matmul(const MatmulArgs& args);
Status grouped_matmul_wgrad(const WgradArgs& args);
Status grouped_bias_grad(const BiasGradArgs& args);
Status grouped_matmul_backward(const BackwardArgs& args);
Status permute(const PermuteArgs& args);
Status unpermute(const UnpermuteArgs& args);
Status unpermute_backward(const UnpermuteBackwardArgs& args);
Status activation(const ActivationArgs& args);
Status activation_backward(const ActivationBackwardArgs& args);
Status softmax_topk(const SoftmaxTopkArgs& args);
Status softmax_topk_backward(const SoftmaxTopkBackwardArgs& args);
Status softmax_topk_tangent(const SoftmaxTopkTangentArgs& args);
Status expert_mlp(const ExpertMlpArgs& args);
Status expert_mlp_backward(const ExpertMlpBackwardArgs& args);
// permute and unpermute's backward with the CUDA backend's sorting steps in `chunks`
// chunks (the CPU uses 1), for the tests.
Status permute_in_chunks(const PermuteArgs& args, int64_t chunks);
Status unpermute_backward_in_chunks(const UnpermuteBackwardArgs& args, int64_t chunks);
// expert_mlp and its backward with each expert's rows multiplied in blocks of at most
// block_rows (the CPU picks its own), for the tests.
Status expert_mlp_in_blocks(const ExpertMlpArgs& args, int64_t block_rows);
Status expert_mlp_backward_in_blocks(const ExpertMlpBackwardArgs& args, int64_t block_rows);
}  // namespace cpu

namespace cuda {
Status grouped_matmul(const MatmulArgs& args, const ExecContext& ctx);
Status grouped_matmul_wgrad(const WgradArgs& args, const ExecContext& ctx);
Status grouped_bias_grad(const BiasGradArgs& args, const ExecContext& ctx);
Status grouped_matmul_backward(const BackwardArgs& args, const ExecContext& ctx);
// The GEMM kernel's own workspace on a device (-1: the current one), beyond the setup
// kernel's arrays: the sm_90a kernels' TMA descriptors, one set per SM; 0 where they
// cannot run (other devices, no device, a build without 90a or without CUDA).
int64_t grouped_matmul_kernel_workspace_bytes(int device_index);
Status permute(const PermuteArgs& args, const ExecContext& ctx);
Status unpermute(const UnpermuteArgs& args, const ExecContext& ctx);
Status unpermute_backward(const UnpermuteBackwardArgs& args, const ExecContext& ctx);
Status activation(const ActivationArgs& args, const ExecContext& ctx);
Status activation_backward(const ActivationBackwardArgs& args, const ExecContext& ctx);
Status softmax_topk(const SoftmaxTopkArgs& args, const ExecContext& ctx);
Status softmax_topk_backward(const SoftmaxTopkBackwardArgs& args, const ExecContext& ctx);
Status softmax_topk_tangent(const SoftmaxTopkTangentArgs& args, const ExecContext& ctx);
Status expert_mlp(const ExpertMlpArgs& args, const ExecContext& ctx);
Status expert_mlp_backward(const ExpertMlpBackwardArgs& args, const ExecContext& ctx);
CaptureRecord capture_record();
}  // namespace cuda
}  // namespace groupgemm
