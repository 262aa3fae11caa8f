// The sm_90a grouped GEMM stage (CUTLASS 3.x, cutlass_sm90.cuh): what it takes beyond a
// GroupedGemmLaunch. Plain host header, so backend.cu needs no CUTLASS 3.x header.
#pragma once

#include <cstddef>

#include "device_info.h"
#include "grouped_gemm.h"
#include "kernel_choice.h"

namespace groupgemm {
namespace cuda {

struct Sm90Launch {
  GroupedGemmLaunch gemm;         // its device's SM count sizes the persistent grid
  Sm90Tile tile;                  // the tile kernel_for chose
  void* kernel_workspace;         // CUTLASS's own workspace (TMA descriptors), 128-byte aligned
  size_t kernel_workspace_bytes;  // what the caller's workspace holds for it
};

// The kernel family (and sm90 tile) for a device: kernel_choice.h's choose_gemm_kernel
// with GROUPGEMM_CUDA_KERNEL (read per call: benchmarks switch it within a process).
KernelChoice choose_kernel(const DeviceInfo& info);

// The sm90 kernels' own workspace on `device_index` (-1: the current device): 0 when
// that device cannot run sm_90a code, when no device is usable, or in builds without 90a.
int64_t sm90_kernel_workspace_bytes(int device_index);

// Runs the sm90 grouped GEMM with `tile` and its own workspace in the
// call's workspace (the region workspace.h's kernel_workspace finds); an error when that
// region is too small.
Status grouped_gemm_sm90(const GroupedGemmLaunch& launch, Sm90Tile tile, void* workspace, int64_t workspace_bytes);

// One TMA + WGMMA grouped GEMM of 16-bit inputs `In` (bf16 or f16) with `Tile` and one
// operand layout, either output dtype, and for a forward layout the bias epilogue too:
// 16-byte aligned operands (kernel_choice.h's sm90_runs). Every (Tile, Layout) of one `In`
// is instantiated in one translation unit (sm90_instances.cu.in).
template <DType In, Sm90Tile Tile, GemmLayout Layout>
Status grouped_gemm_sm90_for(const Sm90Launch& launch);

// CUTLASS's own workspace for the largest of those instantiations, on a device with
// `sm_count` SMs (one set of TMA descriptors per SM).
template <DType In, Sm90Tile Tile, GemmLayout Layout>
size_t sm90_workspace_bytes_for(int sm_count);

}  // namespace cuda
}  // namespace groupgemm
