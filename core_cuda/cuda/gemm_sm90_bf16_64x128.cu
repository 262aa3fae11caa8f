// sm_90a grouped GEMM instantiations: bfloat16 inputs (bfloat16 or float32 output), 64x128 tiles.
#include "cutlass_sm90.cuh"

namespace groupgemm {
namespace cuda {

template Status grouped_gemm_sm90_for<DType::bf16, Sm90Tile::pingpong_64x128>(const Sm90Launch& launch);
template size_t sm90_workspace_bytes_for<DType::bf16, Sm90Tile::pingpong_64x128>(int sm_count);

}  // namespace cuda
}  // namespace groupgemm
