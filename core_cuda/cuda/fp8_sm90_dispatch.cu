// Host side of the sm_90a FP8 grouped GEMM: which instantiation a launch takes and how
// much workspace they need. Compiled for every target; the kernels themselves
// (fp8_sm90_instances.cu) only for sm_90a, when the architectures include 90a
// (GROUPGEMM_WITH_SM90).
#include <algorithm>

#include "fp8_sm90.h"

namespace groupgemm {
namespace cuda {

#ifdef GROUPGEMM_WITH_SM90
bool fp8_sm90_built() { return true; }

Status fp8_grouped_gemm_sm90(const Fp8GemmLaunch& l) {
  const bool f32 = l.out_dtype == DType::f32;
  if (l.lhs_type == Fp8Type::e4m3)
    return f32 ? fp8_grouped_gemm_sm90_for<Fp8Type::e4m3, DType::f32>(l)
               : fp8_grouped_gemm_sm90_for<Fp8Type::e4m3, DType::bf16>(l);
  return f32 ? fp8_grouped_gemm_sm90_for<Fp8Type::e5m2, DType::f32>(l)
             : fp8_grouped_gemm_sm90_for<Fp8Type::e5m2, DType::bf16>(l);
}

size_t fp8_sm90_workspace_bytes(int sm_count) {
  return std::max({fp8_sm90_workspace_bytes_for<Fp8Type::e4m3, DType::bf16>(sm_count),
                   fp8_sm90_workspace_bytes_for<Fp8Type::e4m3, DType::f32>(sm_count),
                   fp8_sm90_workspace_bytes_for<Fp8Type::e5m2, DType::bf16>(sm_count),
                   fp8_sm90_workspace_bytes_for<Fp8Type::e5m2, DType::f32>(sm_count)});
}
#else
bool fp8_sm90_built() { return false; }

Status fp8_grouped_gemm_sm90(const Fp8GemmLaunch&) {
  return Status::Internal("this build has no sm_90a FP8 grouped GEMM");
}

size_t fp8_sm90_workspace_bytes(int) { return 0; }
#endif

}  // namespace cuda
}  // namespace groupgemm
