// The fused expert MLP's small CUDA kernels (expert_mlp_sequence.h names each step): the
// routing, the per-expert GEMM setup, the row steps between the GEMMs, the bias gradients
// and the idle experts' zeros. Each launcher enqueues on `stream` and returns without
// waiting; the row counts they need (the kept rows) are read on the device.
#pragma once

#include <cuda_runtime.h>

#include "expert_mlp_sequence.h"

namespace groupgemm {
namespace cuda {

// The counting sort of expert_mlp.h into the workspace (counting_sort.cuh's four launches).
Status launch_expert_route(const ExpertRouteArgs& args, cudaStream_t stream);
// One thread per local expert writes its entry of every GEMM set.
Status launch_expert_setup(const ExpertSetupArgs& args, cudaStream_t stream);
// One block per kept row, threads over columns.
Status launch_expert_fill_rows(const ExpertFillArgs& args, cudaStream_t stream);
// h in slot order (one block per slot), then the activation (one thread per element).
Status launch_forward_rows(const ForwardRowsArgs& args, cudaStream_t stream);
// One warp per kept row (dprobs' dots in permute.h's lane order); the dropped slots' dprobs.
Status launch_backward_rows(const BackwardRowsArgs& args, cudaStream_t stream);
// One thread per (expert, column), summing the expert's rows in order.
Status launch_expert_sums(const ExpertSumArgs& args, cudaStream_t stream);
// Zeros for the blocks of experts without rows.
Status launch_zero_idle(const IdleFillArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace groupgemm
