// The CUDA kernels of the expert layer's ops. Each launcher enqueues on `stream` and
// returns without waiting; arguments arrive validated, the workspace checked.
#pragma once

#include <cuda_runtime.h>

#include "groupgemm/types.h"

namespace groupgemm {
namespace cuda {

// permute's four steps (groupgemm/permute.h): count and place with one chunk per
// thread, the scan in blocks, the fill with one block per slot.
Status launch_permute(const PermuteArgs& args, void* workspace, cudaStream_t stream);

// unpermute: one block per token, threads over columns.
Status launch_unpermute(const UnpermuteArgs& args, cudaStream_t stream);

// unpermute's backward: for dpermuted, the slots sorted by row in `workspace`
// (row_sort_workspace_layout), then one block per row sums its slots in order; for dprobs,
// one warp per slot in permute.h's fixed lane order.
Status launch_unpermute_backward(const UnpermuteBackwardArgs& args, void* workspace, cudaStream_t stream);

// The activation and its backward, one thread per output element.
Status launch_activation(const ActivationArgs& args, cudaStream_t stream);
Status launch_activation_backward(const ActivationBackwardArgs& args, cudaStream_t stream);

// The router's softmax top-k, its backward and its tangent, one thread per token.
Status launch_softmax_topk(const SoftmaxTopkArgs& args, cudaStream_t stream);
Status launch_softmax_topk_backward(const SoftmaxTopkBackwardArgs& args, cudaStream_t stream);
Status launch_softmax_topk_tangent(const SoftmaxTopkTangentArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace groupgemm
