// CUDA entry points of the fused expert MLP. Its gather-fused kernels are not written yet:
// the call says so, and the frontends run the composition (permute, grouped MLP,
// unpermute) on CUDA devices.
//
// The plan for them, on the pieces the CPU backend and the tests already hold: the routing
// is counting_sort.cuh's sort with groupgemm/expert_mlp.h's WindowBucket and RoutedSlot
// into the workspace of src/expert_mlp_workspace.h; a setup kernel turns bucket_start into
// per-expert problems (rows, pointers and gather offsets into slot_of_row); fc1 is a
// grouped GEMM whose A rows are gathered through slot_of_row / k (CUTLASS 2.x GemmGrouped's
// kernel with the GatherA iterators of GemmUniversal on sm_80, the Hopper gather/scatter
// collective on sm_90a) and whose D rows are scattered to h's slot order; fc2 writes the
// expert-output rows that unpermute's kernel sums per token. The backward gathers dout's
// rows the same way for g = dout @ w_out^T, recomputes the activation and forms dprobs
// and fc1's output gradient in one elementwise kernel, and gathers token rows along the
// contraction of w_in's gradient.
#include "backends.h"

namespace groupgemm {
namespace cuda {

Status expert_mlp(const ExpertMlpArgs&, const ExecContext&) {
  return Status::Unimplemented("expert_mlp has no CUDA kernels yet: run the composition (permute, "
                               "grouped_mlp, unpermute) on CUDA devices");
}

Status expert_mlp_backward(const ExpertMlpBackwardArgs&, const ExecContext&) {
  return Status::Unimplemented("expert_mlp_backward has no CUDA kernels yet: run the composition (permute, "
                               "grouped_mlp, unpermute) on CUDA devices");
}

}  // namespace cuda
}  // namespace groupgemm
