// Which kernel runs a gathered GEMM (an operand read through index arrays: the fused expert
// MLP's): kernel_choice.h's choice, narrowed to what the sm_90a gathered kernel takes. A pure
// host function, so the core tests check it without a GPU.
#pragma once

#include "gather.h"
#include "kernel_choice.h"

namespace groupgemm {

// The kernel that runs one gathered GEMM (gathered_gemm.h): the sm_90a one
// (cutlass_gathered_sm90.cuh, its own 128 x 128 tile whatever the table's) takes a call
// whose A rows are gathered in a forward layout, or a weight gradient (col_row) whose
// contraction is gathered in A or B with the inputs' output type, when the sm90 kernels
// would run it, but only when GROUPGEMM_CUDA_KERNEL asks for them: no GPU has run it yet,
// so the Hopper default is the 2.x kernels.
inline GemmKernel gathered_kernel_for(const KernelChoice& choice, const GroupedGemmCall& call, Gather gather,
                                      bool aligned) {
  const bool forward = call.layout == GemmLayout::row_row || call.layout == GemmLayout::row_col;
  const bool rows_in_forward = gather == Gather::a_rows && forward;
  const bool gathered_contraction = (gather == Gather::a_k || gather == Gather::b_k) &&
                                    call.layout == GemmLayout::col_row && call.out_dtype == call.in_dtype;
  if (!(rows_in_forward || gathered_contraction) || choice.policy == KernelPolicy::hopper_default)
    return GemmKernel::sm80;
  return kernel_for(choice, call, aligned).kernel;
}

}  // namespace groupgemm
