// Backend entry points behind the core's FP8 API (groupgemm/fp8.h). Arguments arrive
// validated by fp8_api.cpp.
#pragma once

#include "groupgemm/fp8.h"

namespace groupgemm {
namespace cpu {
Status quantize_rows(const QuantizeRowsArgs& args);
Status quantize_blocks(const QuantizeBlocksArgs& args);
Status quantize_grouped(const QuantizeGroupedArgs& args);
Status scaled_grouped_matmul(const ScaledMatmulArgs& args);
Status scaled_grouped_matmul_wgrad(const ScaledWgradArgs& args);
}  // namespace cpu

namespace cuda {
Status quantize_rows(const QuantizeRowsArgs& args, const ExecContext& ctx);
Status quantize_blocks(const QuantizeBlocksArgs& args, const ExecContext& ctx);
Status quantize_grouped(const QuantizeGroupedArgs& args, const ExecContext& ctx);
Status scaled_grouped_matmul(const ScaledMatmulArgs& args, const ExecContext& ctx);
Status scaled_grouped_matmul_wgrad(const ScaledWgradArgs& args, const ExecContext& ctx);
// The FP8 GEMM kernel's own workspace on a device (-1: the current one), beyond
// fp8_workspace.h's arrays: its TMA descriptors, one set per SM; 0 where it cannot run.
int64_t fp8_kernel_workspace_bytes(int device_index);
}  // namespace cuda
}  // namespace groupgemm
