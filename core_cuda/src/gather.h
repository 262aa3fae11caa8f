// Which operand of a grouped GEMM is read through per-group gather indices (rows named by
// an index array instead of a copy), and along which dimension. Its own header so that the
// gathered GEMM kernels (CUTLASS instantiations, minutes to build) depend on nothing else
// of the call sequences.
#pragma once

namespace groupgemm {

// A's rows (A row-major), A's contraction (A column-major: a weight gradient's rows), or
// B's contraction (B row-major).
enum class Gather : int { none = 0, a_rows = 1, a_k = 2, b_k = 3 };

}  // namespace groupgemm
