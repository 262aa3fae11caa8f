// The router's softmax top-k, its backward and its tangent on the device: one thread per
// token, running groupgemm/router.h's loops in float32 (the CPU backend runs the same loops).
#include "dtypes.cuh"
#include "groupgemm/router.h"
#include "kernels.h"
#include "expert_kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

unsigned token_blocks(int64_t tokens) { return grid_dim(ceil_div(tokens, kThreads), 65536); }

template <typename T>
__global__ void softmax_topk_kernel(const T* logits, int32_t* indices, float* probs, int64_t tokens,
                                    int64_t experts, int64_t k, bool renormalize) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < tokens;
       t += int64_t(gridDim.x) * blockDim.x) {
    const T* row = logits + t * experts;
    softmax_topk_row<float>([&](int64_t e) { return float(row[e]); }, experts, k, renormalize,
                            indices + t * k, probs + t * k);
  }
}

template <typename T>
__global__ void softmax_topk_backward_kernel(const T* logits, const int32_t* indices, const float* dprobs,
                                             T* dlogits, int64_t tokens, int64_t experts, int64_t k,
                                             bool renormalize) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < tokens;
       t += int64_t(gridDim.x) * blockDim.x) {
    const T* row = logits + t * experts;
    T* drow = dlogits + t * experts;
    softmax_topk_backward_row<float>([&](int64_t e) { return float(row[e]); }, experts, k, renormalize,
                                     indices + t * k, [&](int64_t j) { return dprobs[t * k + j]; },
                                     [&](int64_t e, float v) { drow[e] = T(v); });
  }
}

template <typename T>
__global__ void softmax_topk_tangent_kernel(const T* logits, const int32_t* indices, const T* tlogits,
                                            float* tprobs, int64_t tokens, int64_t experts, int64_t k,
                                            bool renormalize) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < tokens;
       t += int64_t(gridDim.x) * blockDim.x) {
    const T* row = logits + t * experts;
    const T* trow = tlogits + t * experts;
    softmax_topk_tangent_row<float>([&](int64_t e) { return float(row[e]); }, experts, k, renormalize,
                                    indices + t * k, [&](int64_t e) { return float(trow[e]); },
                                    tprobs + t * k);
  }
}

}  // namespace

Status launch_softmax_topk(const SoftmaxTopkArgs& a, cudaStream_t stream) {
  return visit_cuda_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    softmax_topk_kernel<T><<<token_blocks(a.num_tokens), kThreads, 0, stream>>>(
        static_cast<const T*>(a.logits), a.expert_indices, static_cast<float*>(a.probs), a.num_tokens,
        a.num_experts, a.top_k, a.renormalize);
    return last_launch("the softmax top-k kernel");
  });
}

Status launch_softmax_topk_backward(const SoftmaxTopkBackwardArgs& a, cudaStream_t stream) {
  return visit_cuda_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    softmax_topk_backward_kernel<T><<<token_blocks(a.num_tokens), kThreads, 0, stream>>>(
        static_cast<const T*>(a.logits), a.expert_indices, static_cast<const float*>(a.dprobs),
        static_cast<T*>(a.dlogits), a.num_tokens, a.num_experts, a.top_k, a.renormalize);
    return last_launch("the softmax top-k backward kernel");
  });
}

Status launch_softmax_topk_tangent(const SoftmaxTopkTangentArgs& a, cudaStream_t stream) {
  return visit_cuda_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    softmax_topk_tangent_kernel<T><<<token_blocks(a.num_tokens), kThreads, 0, stream>>>(
        static_cast<const T*>(a.logits), a.expert_indices, static_cast<const T*>(a.tlogits),
        static_cast<float*>(a.tprobs), a.num_tokens, a.num_experts, a.top_k, a.renormalize);
    return last_launch("the softmax top-k tangent kernel");
  });
}

}  // namespace cuda
}  // namespace groupgemm
