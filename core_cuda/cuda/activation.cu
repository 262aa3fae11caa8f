// The expert MLP's activation and its backward on the device: one thread per output
// element, groupgemm/activation.h's expressions in float32, rounded once.
#include "dtypes.cuh"
#include "groupgemm/activation.h"
#include "kernels.h"
#include "expert_kernels.h"

namespace groupgemm {
namespace cuda {
namespace {

unsigned element_blocks(int64_t elements) { return grid_dim(ceil_div(elements, kThreads), 65536); }

// Element i of the [rows, out_features] output: its row, column, and where its input
// (and, for swiglu, its up input) sit in the [rows, in_features] h.
struct ElementAt {
  int64_t out, x, up;
};

__device__ ElementAt element_at(int64_t i, int64_t in_features, int64_t out_features, bool swiglu) {
  const int64_t m = i / out_features, f = i % out_features;
  return {i, m * in_features + f, swiglu ? m * in_features + out_features + f : -1};
}

template <typename T>
__global__ void activation_kernel(Activation kind, const T* h, T* out, int64_t elements, int64_t in_features,
                                  int64_t out_features) {
  const bool swiglu = kind == Activation::swiglu;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < elements;
       i += int64_t(gridDim.x) * blockDim.x) {
    const ElementAt e = element_at(i, in_features, out_features, swiglu);
    const float up = swiglu ? float(h[e.up]) : 0.0f;
    out[e.out] = T(activation_forward(kind, float(h[e.x]), up));
  }
}

template <typename T>
__global__ void activation_backward_kernel(Activation kind, const T* dout, const T* h, T* dh,
                                           int64_t elements, int64_t in_features, int64_t out_features) {
  const bool swiglu = kind == Activation::swiglu;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < elements;
       i += int64_t(gridDim.x) * blockDim.x) {
    const ElementAt e = element_at(i, in_features, out_features, swiglu);
    const float up = swiglu ? float(h[e.up]) : 0.0f;
    const ActivationGrad<float> g = activation_backward_at(kind, float(dout[e.out]), float(h[e.x]), up);
    dh[e.x] = T(g.dx);
    if (swiglu) dh[e.up] = T(g.dup);
  }
}

}  // namespace

Status launch_activation(const ActivationArgs& a, cudaStream_t stream) {
  const int64_t out_features = activation_out_features(a.kind, a.in_features);
  const int64_t elements = a.rows * out_features;
  if (elements == 0) return Status::Ok();
  return visit_cuda_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    activation_kernel<T><<<element_blocks(elements), kThreads, 0, stream>>>(
        a.kind, static_cast<const T*>(a.h), static_cast<T*>(a.out), elements, a.in_features, out_features);
    return last_launch("the activation kernel");
  });
}

Status launch_activation_backward(const ActivationBackwardArgs& a, cudaStream_t stream) {
  const int64_t out_features = activation_out_features(a.kind, a.in_features);
  const int64_t elements = a.rows * out_features;
  if (elements == 0) return Status::Ok();
  return visit_cuda_dtype(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    activation_backward_kernel<T><<<element_blocks(elements), kThreads, 0, stream>>>(
        a.kind, static_cast<const T*>(a.dout), static_cast<const T*>(a.h), static_cast<T*>(a.dh), elements,
        a.in_features, out_features);
    return last_launch("the activation backward kernel");
  });
}

}  // namespace cuda
}  // namespace groupgemm
