// Which grouped GEMM kernel family a CUDA call runs: the CUTLASS 2.x GemmGrouped kernels
// ("sm80": Ampere tensor-core MMA, also what every newer GPU runs) or the sm_90a CUTLASS
// 3.x pointer-array kernels ("sm90": TMA + WGMMA, Hopper only). Pure host functions of
// the device's compute capability, GROUPGEMM_CUDA_KERNEL and the call, so the core tests
// check the choice without a GPU.
#pragma once

#include <string>

#include "call_sequence.h"
#include "groupgemm/types.h"

namespace groupgemm {

enum class GemmKernel : int { sm80 = 0, sm90 = 1 };

// The kernel family when GROUPGEMM_CUDA_KERNEL is unset. It stays sm80 on Hopper too
// until the sm90 kernels have passed tests/test_cuda.py on a Hopper GPU: they are
// compiled and statically checked (tests/test_cuda_sass.py) but have never run.
// GROUPGEMM_CUDA_KERNEL=sm90 opts in.
constexpr bool kSm90ByDefault = false;

// sm_90a code runs on compute capability 9.0 exactly (arch-specific, not forward compatible).
inline bool runs_sm90a(int cc_major, int cc_minor) { return cc_major == 9 && cc_minor == 0; }

struct KernelChoice {
  Status status;  // not ok: GROUPGEMM_CUDA_KERNEL asks for what cannot run here
  GemmKernel kernel;
};

// env: GROUPGEMM_CUDA_KERNEL's value, or null when unset. sm90_built: this build holds
// the sm_90a kernels (CMAKE_CUDA_ARCHITECTURES includes 90a).
inline KernelChoice choose_gemm_kernel(int cc_major, int cc_minor, const char* env, bool sm90_built) {
  const bool sm90_here = sm90_built && runs_sm90a(cc_major, cc_minor);
  const std::string want = env ? env : "";
  if (want.empty()) return {Status::Ok(), kSm90ByDefault && sm90_here ? GemmKernel::sm90 : GemmKernel::sm80};
  if (want == "sm80") return {Status::Ok(), GemmKernel::sm80};
  if (want == "sm90") {
    if (sm90_here) return {Status::Ok(), GemmKernel::sm90};
    return {Status::Invalid("GROUPGEMM_CUDA_KERNEL=sm90 needs a compute capability 9.0 GPU and a build with "
                            "the sm_90a kernels (this device is " +
                            std::to_string(cc_major) + "." + std::to_string(cc_minor) +
                            (sm90_built ? ")" : "; this build has no sm_90a code)")),
            GemmKernel::sm80};
  }
  return {Status::Invalid("GROUPGEMM_CUDA_KERNEL must be sm80 or sm90, not '" + want + "'"),
          GemmKernel::sm80};
}

// Whether the sm90 kernels run a call that the choice sent to them. They take 16-bit
// inputs whose operands are 16-byte aligned (TMA's rule, the same as the 2.x tensor-core
// kernel's), and a C that is a real matrix: D itself when accumulating. A forward call
// with bias in the epilogue reads C as one broadcast row (ldc = 0); CUTLASS 3.x loads C
// with TMA, whose descriptors cannot have a zero stride, so such calls keep the 2.x
// kernel. (A float32 output of 16-bit inputs gets its bias afterwards from the late-bias
// kernel, so its GEMM has beta = 0 and runs here.)
inline bool sm90_runs(const GroupedGemmCall& call, bool aligned) {
  const bool sixteen_bit = call.in_dtype == DType::bf16 || call.in_dtype == DType::f16;
  const bool broadcast_c = call.layout != GemmLayout::col_row && call.beta != 0.0f;
  return sixteen_bit && aligned && !broadcast_c;
}

}  // namespace groupgemm
