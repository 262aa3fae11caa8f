// Host side of the sm_90a grouped GEMM: which kernel family a call's device takes
// (kernel_choice.h with the device's compute capability and GROUPGEMM_CUDA_KERNEL), how
// much workspace the sm90 kernels need on a device, and the launch into that workspace.
// Compiled for every target; the kernels themselves (sm90_instances.cu.in) only for
// sm_90a, and only when the build's architectures include 90a (GROUPGEMM_WITH_SM90).
#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "device_checks.h"
#include "gathered_gemm.h"
#include "gemm_sm90.h"
#include "kernel_choice.h"
#include "workspace.h"

namespace groupgemm {
namespace cuda {

#ifdef GROUPGEMM_WITH_SM90
constexpr bool kSm90Built = true;
#else
constexpr bool kSm90Built = false;
#endif

KernelChoice choose_kernel(const DeviceInfo& info) {
  return choose_gemm_kernel(info.cc_major, info.cc_minor, std::getenv("GROUPGEMM_CUDA_KERNEL"), kSm90Built);
}

#ifdef GROUPGEMM_WITH_SM90
namespace {

template <DType In, Sm90Tile Tile>
Status run_sm90_layout(const Sm90Launch& s) {
  switch (s.gemm.layout) {
    case GemmLayout::row_row: return grouped_gemm_sm90_for<In, Tile, GemmLayout::row_row>(s);
    case GemmLayout::row_col: return grouped_gemm_sm90_for<In, Tile, GemmLayout::row_col>(s);
    case GemmLayout::col_row: return grouped_gemm_sm90_for<In, Tile, GemmLayout::col_row>(s);
  }
  return Status::Internal("unknown GEMM layout");
}

template <DType In>
Status run_sm90_tile(const Sm90Launch& s) {
  switch (s.tile) {
#define GG_SM90_TILE(name, schedule, tile_m, tile_n, tile_k, cluster_m, cluster_n) \
  case Sm90Tile::name:                                                              \
    return run_sm90_layout<In, Sm90Tile::name>(s);
#include "hopper_kernels.def"
  }
  return Status::Internal("the sm90 grouped GEMM was launched with an unknown tile");
}

template <DType In, Sm90Tile Tile>
size_t most_workspace_of(int sm_count) {
  return std::max({sm90_workspace_bytes_for<In, Tile, GemmLayout::row_row>(sm_count),
                   sm90_workspace_bytes_for<In, Tile, GemmLayout::row_col>(sm_count),
                   sm90_workspace_bytes_for<In, Tile, GemmLayout::col_row>(sm_count)});
}

// Every instantiation's: the tile is chosen per call, after the workspace was sized.
template <DType In>
size_t most_workspace_of_dtype(int sm_count) {
  size_t most = 0;
#define GG_SM90_TILE(name, schedule, tile_m, tile_n, tile_k, cluster_m, cluster_n) \
  most = std::max(most, most_workspace_of<In, Sm90Tile::name>(sm_count));
#include "hopper_kernels.def"
  return most;
}

}  // namespace
#endif

// Per device, sized once (it depends on the device's SM count only).
int64_t sm90_kernel_workspace_bytes(int device_index) {
  if (!kSm90Built) return 0;
  int device = device_index;
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: no call can run, nothing to size
    return 0;
  }
  constexpr int kMaxDevices = 64;
  static std::atomic<int64_t> cached[kMaxDevices] = {};  // 0: not yet sized, -1: no sm_90a there
  if (device >= 0 && device < kMaxDevices) {
    const int64_t bytes = cached[device].load(std::memory_order_relaxed);
    if (bytes != 0) return bytes > 0 ? bytes : 0;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return 0;
  }
  DeviceInfo info{};
  if (device >= count || !device_info(device, &info).ok()) return 0;
  int64_t bytes = -1;  // cannot run sm_90a code
#ifdef GROUPGEMM_WITH_SM90
  if (runs_sm90a(info.cc_major, info.cc_minor))
    bytes = static_cast<int64_t>(std::max(most_workspace_of_dtype<DType::bf16>(info.sm_count),
                                          most_workspace_of_dtype<DType::f16>(info.sm_count)));
#endif
  if (device >= 0 && device < kMaxDevices) cached[device].store(bytes, std::memory_order_relaxed);
  return bytes > 0 ? bytes : 0;
}

Status grouped_gemm_sm90(const GroupedGemmLaunch& launch, Sm90Tile tile, void* workspace,
                         int64_t workspace_bytes) {
#ifdef GROUPGEMM_WITH_SM90
  const KernelWorkspace kw = kernel_workspace(workspace, workspace_bytes, launch.num_groups);
  const Sm90Launch s{launch, tile, kw.data, static_cast<size_t>(kw.bytes)};
  if (launch.in_dtype == DType::bf16) return run_sm90_tile<DType::bf16>(s);
  if (launch.in_dtype == DType::f16) return run_sm90_tile<DType::f16>(s);
  return Status::Internal("the sm90 grouped GEMM takes bfloat16 or float16 inputs");
#else
  (void)launch, (void)tile, (void)workspace, (void)workspace_bytes;
  return Status::Internal("this build has no sm_90a grouped GEMM");
#endif
}

Status gathered_gemm_sm90(const GatheredGemmLaunch& launch) {
#ifdef GROUPGEMM_WITH_SM90
  if (launch.gemm.in_dtype == DType::bf16) return gathered_gemm_sm90_for<DType::bf16>(launch);
  if (launch.gemm.in_dtype == DType::f16) return gathered_gemm_sm90_for<DType::f16>(launch);
  return Status::Internal("the gathered sm90 GEMM takes bfloat16 or float16 inputs");
#else
  (void)launch;
  return Status::Internal("this build has no sm_90a gathered GEMM");
#endif
}

}  // namespace cuda
}  // namespace groupgemm
