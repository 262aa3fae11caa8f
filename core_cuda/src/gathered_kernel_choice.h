// Which kernel runs a gathered GEMM (an operand read through index arrays: the fused expert
// MLP's): kernel_choice.h's choice, narrowed to what the sm_90a gathered kernel takes. A pure
// host function, so the core tests check it without a GPU.
#pragma once

#include "gather.h"
#include "kernel_choice.h"

namespace groupgemm {

// The kernel that runs one gathered GEMM (gathered_gemm.h): the sm_90a one
// (cutlass_gathered_sm90.cuh, its own 128 x 128 tile whatever the table's) takes a call
// whose A rows are gathered in a forward layout when the sm90 kernels would run it, but only
// when GROUPGEMM_CUDA_KERNEL asks for them: no GPU has run it yet, so the Hopper default is
// the 2.x kernels. A weight gradient's gathered contraction always runs the 2.x kernels.
inline GemmKernel gathered_kernel_for(const KernelChoice& choice, const GroupedGemmCall& call, Gather gather,
                                      bool aligned) {
  const bool forward = call.layout == GemmLayout::row_row || call.layout == GemmLayout::row_col;
  if (gather != Gather::a_rows || !forward || choice.policy == KernelPolicy::hopper_default) return GemmKernel::sm80;
  return kernel_for(choice, call, aligned).kernel;
}

}  // namespace groupgemm
