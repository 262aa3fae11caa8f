// sm_90a grouped GEMM instantiations: float16 inputs (float16 or float32 output), 128x256 tiles.
#include "cutlass_sm90.cuh"

namespace groupgemm {
namespace cuda {

template Status grouped_gemm_sm90_for<DType::f16, Sm90Tile::cooperative_128x256>(const Sm90Launch& launch);
template size_t sm90_workspace_bytes_for<DType::f16, Sm90Tile::cooperative_128x256>(int sm_count);

}  // namespace cuda
}  // namespace groupgemm
