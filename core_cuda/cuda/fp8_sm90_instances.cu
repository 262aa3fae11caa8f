// The sm_90a FP8 grouped GEMM's instantiations (fp8_sm90.h): e4m3 or e5m2 A, float8_e4m3fn B,
// bfloat16 or float32 output. One translation unit, compiled for sm_90a alone: the four
// share most of their compile (about 90 s of one core together, 270 s as four units).
#include "fp8_sm90.cuh"

namespace groupgemm {
namespace cuda {

#define GG_FP8_SM90_INSTANCE(lhs, out)                                                                \
  template Status fp8_grouped_gemm_sm90_for<Fp8Type::lhs, DType::out>(const Fp8GemmLaunch& launch); \
  template size_t fp8_sm90_workspace_bytes_for<Fp8Type::lhs, DType::out>(int sm_count);
GG_FP8_SM90_INSTANCE(e4m3, bf16)
GG_FP8_SM90_INSTANCE(e4m3, f32)
GG_FP8_SM90_INSTANCE(e5m2, bf16)
GG_FP8_SM90_INSTANCE(e5m2, f32)
#undef GG_FP8_SM90_INSTANCE

}  // namespace cuda
}  // namespace groupgemm
