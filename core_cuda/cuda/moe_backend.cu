// CUDA entry points of the expert layer's ops. Their kernels are not written yet: each
// reports that clearly rather than running.
#include "backends.h"

namespace groupgemm {
namespace cuda {
namespace {
Status not_yet() { return Status::Unimplemented("the expert-layer ops have no CUDA kernels yet"); }
}  // namespace

Status permute(const PermuteArgs&, const ExecContext&) { return not_yet(); }
Status unpermute(const UnpermuteArgs&, const ExecContext&) { return not_yet(); }
Status unpermute_backward(const UnpermuteBackwardArgs&, const ExecContext&) { return not_yet(); }
Status activation(const ActivationArgs&, const ExecContext&) { return not_yet(); }
Status activation_backward(const ActivationBackwardArgs&, const ExecContext&) { return not_yet(); }

}  // namespace cuda
}  // namespace groupgemm
