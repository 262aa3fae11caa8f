// Backend entry points behind the core API. Arguments arrive already validated.
#pragma once

#include "groupgemm/types.h"

namespace groupgemm {
namespace cpu {
Status grouped_matmul(const MatmulArgs& args);
Status grouped_matmul_wgrad(const WgradArgs& args);
Status grouped_bias_grad(const BiasGradArgs& args);
}  // namespace cpu

namespace cuda {
Status grouped_matmul(const MatmulArgs& args, const ExecContext& ctx);
Status grouped_matmul_wgrad(const WgradArgs& args, const ExecContext& ctx);
Status grouped_bias_grad(const BiasGradArgs& args, const ExecContext& ctx);
}  // namespace cuda
}  // namespace groupgemm
