// CUDA entry points of the fused expert MLP. Its gather-fused kernels are not written yet:
// the call says so, and the frontends run the composition (permute, grouped MLP,
// unpermute) on CUDA devices.
#include "backends.h"

namespace groupgemm {
namespace cuda {

Status expert_mlp(const ExpertMlpArgs&, const ExecContext&) {
  return Status::Unimplemented(
      "expert_mlp has no CUDA kernels yet: run the composition (permute, "
      "grouped_mlp, unpermute) on CUDA devices");
}

Status expert_mlp_backward(const ExpertMlpBackwardArgs&, const ExecContext&) {
  return Status::Unimplemented(
      "expert_mlp_backward has no CUDA kernels yet: run the composition (permute, "
      "grouped_mlp, unpermute) on CUDA devices");
}

}  // namespace cuda
}  // namespace groupgemm
