// Which grouped GEMM kernel family a CUDA call runs: the CUTLASS 2.x GemmGrouped kernels
// ("sm80": Ampere tensor-core MMA, also what every newer GPU runs) or the sm_90a CUTLASS
// 3.x pointer-array kernels ("sm90": TMA + WGMMA, Hopper only). Pure host functions of
// the device's compute capability, GROUPGEMM_CUDA_KERNEL and the call, so the core tests
// check the choice without a GPU.
#pragma once

#include <string>

#include "gemm_call.h"
#include "groupgemm/types.h"

namespace groupgemm {

enum class GemmKernel : int { sm80 = 0, sm90 = 1 };

// The sm90 family's CTA tiles:
// - cooperative_128x256: 128 x 256 output tiles, 64-deep K steps, two consumer warp groups
//   on one tile, 2 x 1 clusters (two CTAs along M share each weight tile through TMA
//   multicast); for groups with many rows and columns;
// - pingpong_64x128: 64 x 128 tiles, 128-deep K steps, two consumer warp groups on
//   alternate tiles (one's epilogue overlaps the other's mainloop), 2 x 1 clusters; for
//   groups with few rows or columns, where a large tile would be mostly padding;
// - cooperative_256x128: 256 x 128 x 64 with 1 x 2 clusters (two CTAs along N share each
//   token tile), the shape of cuBLAS's fastest dense kernels on Hopper; a candidate for
//   large groups that the shape rule does not choose until a GPU run shows it faster.
// by_shape: the call's shape chooses (sm90_tile_for).
enum class Sm90Tile : int { by_shape = 0, cooperative_128x256 = 1, pingpong_64x128 = 2, cooperative_256x128 = 3 };

// The kernel family when GROUPGEMM_CUDA_KERNEL is unset. It stays sm80 on Hopper too
// until the sm90 kernels are faster there: at an earlier 128 x 128 tile they passed
// tests/test_cuda.py on an H100 but did not reach the speed targets (README, "On an
// NVIDIA H100"). GROUPGEMM_CUDA_KERNEL=sm90 opts in.
constexpr bool kSm90ByDefault = false;

// sm_90a code runs on compute capability 9.0 exactly (arch-specific, not forward compatible).
inline bool runs_sm90a(int cc_major, int cc_minor) { return cc_major == 9 && cc_minor == 0; }

struct KernelChoice {
  Status status;  // not ok: GROUPGEMM_CUDA_KERNEL asks for what cannot run here
  GemmKernel kernel;
  Sm90Tile tile;  // for sm90: by_shape unless GROUPGEMM_CUDA_KERNEL names a tile
};

// env: GROUPGEMM_CUDA_KERNEL's value, or null when unset: a family, or the sm90 family
// held to one tile (for measuring and testing each tile whatever the shape). sm90_built:
// this build holds the sm_90a kernels (CMAKE_CUDA_ARCHITECTURES includes 90a).
inline KernelChoice choose_gemm_kernel(int cc_major, int cc_minor, const char* env, bool sm90_built) {
  const bool sm90_here = sm90_built && runs_sm90a(cc_major, cc_minor);
  const std::string want = env ? env : "";
  if (want.empty())
    return {Status::Ok(), kSm90ByDefault && sm90_here ? GemmKernel::sm90 : GemmKernel::sm80,
            Sm90Tile::by_shape};
  if (want == "sm80") return {Status::Ok(), GemmKernel::sm80, Sm90Tile::by_shape};
  Sm90Tile tile = Sm90Tile::by_shape;
  if (want == "sm90_128x256")
    tile = Sm90Tile::cooperative_128x256;
  else if (want == "sm90_64x128")
    tile = Sm90Tile::pingpong_64x128;
  else if (want == "sm90_256x128")
    tile = Sm90Tile::cooperative_256x128;
  else if (want != "sm90")
    return {Status::Invalid("GROUPGEMM_CUDA_KERNEL must be sm80, sm90, sm90_128x256, sm90_64x128 or "
                            "sm90_256x128, not '" +
                            want + "'"),
            GemmKernel::sm80, Sm90Tile::by_shape};
  if (sm90_here) return {Status::Ok(), GemmKernel::sm90, tile};
  return {Status::Invalid(
              "GROUPGEMM_CUDA_KERNEL=" + want +
              " needs a compute capability 9.0 GPU and a build with the sm_90a kernels (this device is " +
              std::to_string(cc_major) + "." + std::to_string(cc_minor) +
              (sm90_built ? ")" : "; this build has no sm_90a code)")),
          GemmKernel::sm80, Sm90Tile::by_shape};
}

// The tile for a call when the shape chooses. The host knows every group's column count
// and the total rows, not each group's rows (they stay on the device): a forward or dgrad
// GEMM's groups share its M rows, so their mean M / G is what a tile sees under balanced
// routing; a weight gradient's groups each have K rows (its contraction runs over the
// group's tokens). Groups of at most 128 rows or columns take the small tile, as
// torch._grouped_mm's sm90 kernels do, the rest the large one.
inline Sm90Tile sm90_tile_for(const GroupedGemmCall& call) {
  const int64_t groups = call.num_groups > 0 ? call.num_groups : 1;
  const int64_t rows = call.layout == GemmLayout::col_row ? call.max_m : call.max_m / groups;
  return rows <= 128 || call.n <= 128 ? Sm90Tile::pingpong_64x128 : Sm90Tile::cooperative_128x256;
}

// Whether the sm90 kernels run a call that the choice sent to them. They take 16-bit
// inputs whose operands are 16-byte aligned (TMA's rule, the same as the 2.x tensor-core
// kernel's), with any C: none, the bias row (an epilogue that broadcasts each group's
// row) or the output itself.
inline bool sm90_runs(const GroupedGemmCall& call, bool aligned) {
  return (call.in_dtype == DType::bf16 || call.in_dtype == DType::f16) && aligned;
}

}  // namespace groupgemm
