// The CUTLASS layout tags of a GEMM's A and B operands for each GemmLayout the core
// runs, shared by the CUTLASS 2.x (sm_80) and 3.x (sm_90a) grouped GEMMs.
#pragma once

#include "gemm_call.h"
#include "cutlass/layout/matrix.h"

namespace groupgemm {
namespace cuda {

template <GemmLayout L>
struct OperandLayouts;
template <>
struct OperandLayouts<GemmLayout::row_row> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct OperandLayouts<GemmLayout::row_col> {
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct OperandLayouts<GemmLayout::col_row> {
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

}  // namespace cuda
}  // namespace groupgemm
