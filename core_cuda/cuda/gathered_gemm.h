// The gathered grouped GEMM of the CUDA backend: a grouped GEMM (grouped_gemm.h's launch:
// device problems, pointers and leading dimensions per group) one of whose operands is read
// through per-group index arrays (gather.h), so token rows enter a GEMM without a copy. Plain
// host header (no CUTLASS), shared by the entry points and the CUTLASS translation units.
#pragma once

#include "gather.h"
#include "grouped_gemm.h"

namespace groupgemm {
namespace cuda {

struct GatheredGemmLaunch {
  GroupedGemmLaunch gemm;
  const int32_t* const* indices;  // device array: each group's indices (rows of the gathered operand)
  Gather gather;                  // a_rows with row_row or row_col; a_k or b_k with col_row
};

// 16-bit inputs run on tensor cores when every row is 16-byte aligned (aligned == true);
// otherwise a plain tiled kernel runs. float32 runs exact fp32 FMA (no TF32) at any
// alignment. Deterministic: one thread block owns each output tile and its whole K loop.
Status gathered_gemm(const GatheredGemmLaunch& launch, bool aligned);

// Per input dtype (gathered_gemm_instances.cu), and the plain tiled kernel.
Status gathered_gemm_bf16(const GatheredGemmLaunch& launch);
Status gathered_gemm_f16(const GatheredGemmLaunch& launch);
Status gathered_gemm_f32(const GatheredGemmLaunch& launch);
Status gathered_gemm_unaligned(const GatheredGemmLaunch& launch);

// The sm_90a gathered GEMM (cutlass_gathered_sm90.cuh), for the calls gathered_kernel_choice.h
// gives it: 16-bit inputs with 16-byte aligned rows, A's rows gathered in a forward layout or
// a weight gradient's contraction gathered (its output in the inputs' type). An error in a
// build without sm_90a code.
Status gathered_gemm_sm90(const GatheredGemmLaunch& launch);

// Its halves per input type (bf16, f16), instantiated in that type's sm_90a translation
// unit (sm90_instances.cu.in).
template <DType In>
Status gathered_gemm_sm90_for(const GatheredGemmLaunch& launch);

}  // namespace cuda
}  // namespace groupgemm
