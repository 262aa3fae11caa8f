// The framework-free core API: one entry point per GEMM kind and per expert-layer op.
// Each takes raw pointers, shapes, dtypes, device-resident index arrays and an execution
// context, validates what can be checked without reading device memory, and returns a
// Status.
#pragma once

#include "groupgemm/types.h"

namespace groupgemm {

// Forward (and dgrad, with the transpose flag flipped): see MatmulArgs.
Status grouped_matmul(const MatmulArgs& args, const ExecContext& ctx);

// Weight gradient, overwrite or accumulate: see WgradArgs.
Status grouped_matmul_wgrad(const WgradArgs& args, const ExecContext& ctx);

// Bias gradient: see BiasGradArgs.
Status grouped_bias_grad(const BiasGradArgs& args, const ExecContext& ctx);

// The input, weight and bias gradients of a grouped_matmul at once: see BackwardArgs.
Status grouped_matmul_backward(const BackwardArgs& args, const ExecContext& ctx);

// Bytes of workspace each GEMM entry point needs on `device` for num_groups local groups
// (0 on CPU). On CUDA it also depends on the GPU (device_index, -1: the current device):
// a compute capability 9.0 device adds the sm_90a kernels' workspace, which grows with
// its SM count.
int64_t grouped_matmul_workspace_bytes(Device device, int64_t num_groups, int device_index = -1);

// The expert layer's token ops and activation: see PermuteArgs, UnpermuteArgs,
// UnpermuteBackwardArgs, ActivationArgs and ActivationBackwardArgs; the router's softmax
// top-k: see SoftmaxTopkArgs, SoftmaxTopkBackwardArgs and SoftmaxTopkTangentArgs.
Status permute(const PermuteArgs& args, const ExecContext& ctx);
Status unpermute(const UnpermuteArgs& args, const ExecContext& ctx);
Status unpermute_backward(const UnpermuteBackwardArgs& args, const ExecContext& ctx);
Status activation(const ActivationArgs& args, const ExecContext& ctx);
Status activation_backward(const ActivationBackwardArgs& args, const ExecContext& ctx);
Status softmax_topk(const SoftmaxTopkArgs& args, const ExecContext& ctx);
Status softmax_topk_backward(const SoftmaxTopkBackwardArgs& args, const ExecContext& ctx);
Status softmax_topk_tangent(const SoftmaxTopkTangentArgs& args, const ExecContext& ctx);

// The fused expert MLP and its backward: see ExpertMlpArgs and ExpertMlpBackwardArgs. The
// CUDA backend needs expert_mlp_workspace_bytes(cuda, T * k, E, H, F_in, activation,
// element bytes of the values, backward) bytes of workspace (the routing, the GEMMs'
// per-expert arrays and the call's row scratch); the CPU none.
Status expert_mlp(const ExpertMlpArgs& args, const ExecContext& ctx);
Status expert_mlp_backward(const ExpertMlpBackwardArgs& args, const ExecContext& ctx);
int64_t expert_mlp_workspace_bytes(Device device, int64_t num_slots, int64_t num_experts, int64_t hidden,
                                   int64_t in_features, Activation activation, int64_t value_bytes,
                                   bool backward);

// Bytes of workspace permute needs on `device` for num_slots = T * k slots and
// num_experts experts (0 on CPU; a function of its arguments only).
int64_t permute_workspace_bytes(Device device, int64_t num_slots, int64_t num_experts);

// Bytes of workspace unpermute_backward needs on `device` to compute dpermuted for
// num_slots = T * k slots (0 on CPU; a function of num_slots only).
int64_t unpermute_backward_workspace_bytes(Device device, int64_t num_slots);

// True when this build contains the CUDA backend.
bool cuda_compiled();

// The CUDA architectures its device code was compiled for, comma-separated as
// CMAKE_CUDA_ARCHITECTURES writes them ("80,90a-real"); "" without the CUDA backend.
const char* cuda_architectures();

// The process's CaptureRecord so far.
CaptureRecord cuda_capture_record();

}  // namespace groupgemm
