// The CUDA kernels of the expert layer's ops. Each launcher enqueues on `stream` and
// returns without waiting; arguments arrive validated, the workspace checked.
#pragma once

#include <cuda_runtime.h>

#include "groupgemm/types.h"

namespace groupgemm {
namespace cuda {

// permute's four steps (groupgemm/permute.h): count and assign with one chunk per
// thread, the scan in one block, the fill with one block per slot.
Status launch_permute(const PermuteArgs& args, void* workspace, cudaStream_t stream);

// unpermute: one block per token, threads over columns.
Status launch_unpermute(const UnpermuteArgs& args, cudaStream_t stream);

// unpermute's backward: dpermuted zeroed, then one block per slot writes its row, its
// first warp the slot's dprobs in permute.h's fixed lane order.
Status launch_unpermute_backward(const UnpermuteBackwardArgs& args, cudaStream_t stream);

// The activation and its backward, one thread per output element.
Status launch_activation(const ActivationArgs& args, cudaStream_t stream);
Status launch_activation_backward(const ActivationBackwardArgs& args, cudaStream_t stream);

// The router's softmax top-k and its backward, one thread per token.
Status launch_softmax_topk(const SoftmaxTopkArgs& args, cudaStream_t stream);
Status launch_softmax_topk_backward(const SoftmaxTopkBackwardArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace groupgemm
