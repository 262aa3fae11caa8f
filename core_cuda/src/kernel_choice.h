// Which grouped GEMM kernel a CUDA call runs: the CUTLASS 2.x GemmGrouped kernels ("sm80":
// Ampere tensor-core MMA, also what every newer GPU runs) or the sm_90a CUTLASS 3.x
// pointer-array kernels ("sm90": TMA + WGMMA, Hopper only) with one of their tiles. Pure
// host functions of the device's compute capability, GROUPGEMM_CUDA_KERNEL, the Hopper
// kernel table (hopper_kernels.def) and the call, so the core tests check the choice
// without a GPU.
#pragma once

#include <algorithm>
#include <iterator>
#include <string>

#include "gemm_call.h"
#include "groupgemm/types.h"

namespace groupgemm {

enum class GemmKernel : int { sm80 = 0, sm90 = 1 };

// The sm90 family's tiles, one per GG_SM90_TILE row of the table.
enum class Sm90Tile : int {
#define GG_SM90_TILE(name, schedule, tile_m, tile_n, tile_k, cluster_m, cluster_n) name,
#include "hopper_kernels.def"
};

constexpr const char* kSm90TileNames[] = {
#define GG_SM90_TILE(name, schedule, tile_m, tile_n, tile_k, cluster_m, cluster_n) #name,
#include "hopper_kernels.def"
};
constexpr int kNumSm90Tiles = sizeof(kSm90TileNames) / sizeof(kSm90TileNames[0]);

// What runs one GEMM: the 2.x kernels (tile unused), or the sm90 kernels with a tile.
struct GemmKernelChoice {
  GemmKernel kernel;
  Sm90Tile tile;
};

// The table's choices: which kernel runs a class of calls on a compute capability 9.0 GPU.
struct HopperChoice {
  int64_t smaller_side_at_most;  // 0: any
  GemmKernelChoice default_kernel;
  Sm90Tile sm90_tile;
};

namespace hopper_kernels {  // the names the table's rows use
constexpr GemmKernelChoice sm80{GemmKernel::sm80, Sm90Tile{}};
#define GG_SM90_TILE(name, schedule, tile_m, tile_n, tile_k, cluster_m, cluster_n) \
  constexpr GemmKernelChoice name{GemmKernel::sm90, Sm90Tile::name};
#include "hopper_kernels.def"
}  // namespace hopper_kernels

constexpr HopperChoice kHopperChoices[] = {
#define GG_HOPPER_CHOICE(smaller_side_at_most, default_kernel, sm90_tile) \
  {smaller_side_at_most, hopper_kernels::default_kernel, Sm90Tile::sm90_tile},
#include "hopper_kernels.def"
};

static_assert(kHopperChoices[std::size(kHopperChoices) - 1].smaller_side_at_most == 0,
              "hopper_kernels.def: the last GG_HOPPER_CHOICE must take any size (0)");

// sm_90a code runs on compute capability 9.0 exactly (arch-specific, not forward compatible).
inline bool runs_sm90a(int cc_major, int cc_minor) { return cc_major == 9 && cc_minor == 0; }

// How a device's calls choose their kernel, decided once per call sequence.
enum class KernelPolicy : int {
  sm80,            // the 2.x kernels: any GPU but Hopper by default, or GROUPGEMM_CUDA_KERNEL=sm80
  hopper_default,  // Hopper, GROUPGEMM_CUDA_KERNEL unset: the table's default column
  sm90_by_shape,   // GROUPGEMM_CUDA_KERNEL=sm90: the table's sm90 column
  sm90_tile,       // GROUPGEMM_CUDA_KERNEL names a tile: that tile whatever the shape
};

struct KernelChoice {
  Status status;  // not ok: GROUPGEMM_CUDA_KERNEL asks for what cannot run here
  KernelPolicy policy;
  Sm90Tile tile;  // for sm90_tile
};

inline std::string kernel_names() {
  std::string names = "sm80, sm90";
  for (const char* tile : kSm90TileNames) names += std::string(", ") + tile;
  return names;
}

// env: GROUPGEMM_CUDA_KERNEL's value, or null when unset: a family, or the sm90 family
// held to one tile (for measuring and testing each tile whatever the shape). sm90_built:
// this build holds the sm_90a kernels (CMAKE_CUDA_ARCHITECTURES includes 90a).
inline KernelChoice choose_gemm_kernel(int cc_major, int cc_minor, const char* env, bool sm90_built) {
  const bool sm90_here = sm90_built && runs_sm90a(cc_major, cc_minor);
  const std::string want = env ? env : "";
  const KernelChoice sm80{Status::Ok(), KernelPolicy::sm80, Sm90Tile{}};
  if (want.empty()) return sm90_here ? KernelChoice{Status::Ok(), KernelPolicy::hopper_default, Sm90Tile{}} : sm80;
  if (want == "sm80") return sm80;
  KernelChoice sm90{Status::Ok(), KernelPolicy::sm90_by_shape, Sm90Tile{}};
  if (want != "sm90") {
    const auto* named = std::find(std::begin(kSm90TileNames), std::end(kSm90TileNames), want);
    if (named == std::end(kSm90TileNames))
      return {Status::Invalid("GROUPGEMM_CUDA_KERNEL must be one of " + kernel_names() + ", not '" + want + "'"),
              KernelPolicy::sm80, Sm90Tile{}};
    sm90 = {Status::Ok(), KernelPolicy::sm90_tile, static_cast<Sm90Tile>(named - std::begin(kSm90TileNames))};
  }
  if (sm90_here) return sm90;
  return {Status::Invalid(
              "GROUPGEMM_CUDA_KERNEL=" + want +
              " needs a compute capability 9.0 GPU and a build with the sm_90a kernels (this device is " +
              std::to_string(cc_major) + "." + std::to_string(cc_minor) +
              (sm90_built ? ")" : "; this build has no sm_90a code)")),
          KernelPolicy::sm80, Sm90Tile{}};
}

// A call's class in the table: the smaller of its rows per group and its columns, the
// sides a tile covers. The host knows every group's column count and the total rows, not
// each group's rows (they stay on the device): a forward or dgrad GEMM's groups share its
// M rows, so their mean M / G is what a tile sees under balanced routing; a weight
// gradient's groups each have K rows (its contraction runs over the group's tokens).
inline int64_t smaller_side(const GroupedGemmCall& call) {
  const int64_t groups = call.num_groups > 0 ? call.num_groups : 1;
  const int64_t rows = call.layout == GemmLayout::col_row ? call.max_m : call.max_m / groups;
  return std::min(rows, call.n);
}

// The table's row for a call.
inline const HopperChoice& hopper_choice(const GroupedGemmCall& call) {
  const int64_t side = smaller_side(call);
  for (const HopperChoice& row : kHopperChoices)
    if (row.smaller_side_at_most == 0 || side <= row.smaller_side_at_most) return row;
  return kHopperChoices[std::size(kHopperChoices) - 1];  // not reached: the last row takes any size
}

// Whether the sm90 kernels can run a call. They take 16-bit inputs whose operands are
// 16-byte aligned (TMA's rule, the same as the 2.x tensor-core kernel's), with any C:
// none, the bias row (an epilogue that broadcasts each group's row) or the output itself.
inline bool sm90_runs(const GroupedGemmCall& call, bool aligned) {
  return (call.in_dtype == DType::bf16 || call.in_dtype == DType::f16) && aligned;
}

// The kernel that runs one call under a device's choice: the 2.x kernels take what the
// sm90 kernels cannot run.
inline GemmKernelChoice kernel_for(const KernelChoice& choice, const GroupedGemmCall& call, bool aligned) {
  const GemmKernelChoice sm80{GemmKernel::sm80, Sm90Tile{}};
  if (!sm90_runs(call, aligned)) return sm80;
  switch (choice.policy) {
    case KernelPolicy::sm80: return sm80;
    case KernelPolicy::hopper_default: return hopper_choice(call).default_kernel;
    case KernelPolicy::sm90_by_shape: return {GemmKernel::sm90, hopper_choice(call).sm90_tile};
    case KernelPolicy::sm90_tile: return {GemmKernel::sm90, choice.tile};
  }
  return sm80;
}

}  // namespace groupgemm
