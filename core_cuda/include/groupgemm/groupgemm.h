// The framework-free core API: one entry point per GEMM kind. Each takes raw pointers,
// shapes, dtypes, the device-resident group sizes and an execution context, validates
// what can be checked without reading device memory, and returns a Status.
#pragma once

#include "groupgemm/types.h"

namespace groupgemm {

// Forward (and dgrad, with the transpose flag flipped): see MatmulArgs.
Status grouped_matmul(const MatmulArgs& args, const ExecContext& ctx);

// Weight gradient, overwrite or accumulate: see WgradArgs.
Status grouped_matmul_wgrad(const WgradArgs& args, const ExecContext& ctx);

// Bias gradient: see BiasGradArgs.
Status grouped_bias_grad(const BiasGradArgs& args, const ExecContext& ctx);

// Bytes of workspace each entry point needs on `device` for num_groups local groups
// (0 on CPU).
int64_t grouped_matmul_workspace_bytes(Device device, int64_t num_groups);

// True when this build contains the CUDA backend.
bool cuda_compiled();

}  // namespace groupgemm
