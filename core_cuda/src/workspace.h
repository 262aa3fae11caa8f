// The CUDA backend's per-call workspace: what its setup kernel writes from the device-
// resident group sizes, and what the GEMM kernels then read. The caller
// provides the memory (an XLA output buffer, a torch tensor), so nothing is allocated at
// run time and a CUDA graph can replay the call.
//
// The layout and the per-group writes are __host__ __device__ so the CPU tests check the
// same pointer and leading-dimension arithmetic the GPU runs.
//
// Both GEMM kernels read the same arrays: CUTLASS 2.x takes `problem` as GemmCoord and
// the ld arrays as int64 leading dimensions; the sm_90a CUTLASS 3.x kernel takes `problem`
// as its per-group cute::Shape<int, int, int> and each ld array as its per-group stride
// (one run-time int64 each; cuda/cutlass_sm90.cuh asserts both layouts). The 3.x kernel
// also needs a workspace of its own (TMA descriptors, one set per SM): the last region,
// whose size the caller learns from grouped_matmul_workspace_bytes for its device.
#pragma once

#include <cstdint>

#include "groupgemm/problem.h"

namespace groupgemm {

// The call's group window and offset, as the setup kernel read them from the device.
struct WindowHeader {
  GroupWindow window;
  int64_t group_offset;
  int64_t reserved;  // keeps the header 32 bytes
};

// A backward runs two grouped GEMMs (the input gradient and the weight gradient) from one
// setup, so the workspace holds two sets of per-group GEMM arrays; a forward uses the first.
constexpr int kGemmSets = 2;

// Byte offsets of one set's arrays.
struct GemmArraysLayout {
  int64_t action;   // int32[G]: GroupAction of each local group
  int64_t problem;  // int32[3 G]: (m, n, k) per group, CUTLASS's GemmCoord; 0s unless gemm
  int64_t ptr[4];   // void*[G] each: A, B, C, D of each group
  int64_t ld[4];    // int64[G] each: lda, ldb, ldc, ldd
};

// Byte offsets of the workspace arrays for G local groups, each 16-byte aligned.
struct WorkspaceLayout {
  int64_t window;    // WindowHeader: the group window and group_offset
  int64_t boundary;  // int64[G + 1]: the window's row boundaries
  GemmArraysLayout gemm[kGemmSets];
  int64_t kernel;  // the sm_90a kernel's own workspace, kernel_bytes plus alignment slack
  int64_t bytes;   // total size
};

// The sm_90a kernel's TMA descriptors need 64-byte alignment; the caller's workspace is
// only 16-byte aligned, so its region has room to be aligned up to this at run time.
constexpr int64_t kKernelWorkspaceAlignment = 128;

GG_HD int64_t align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// kernel_bytes: the sm_90a kernel's own workspace on the call's device (0 elsewhere). The
// two GEMMs of a backward run one after the other on one stream, so they share it.
GG_HD WorkspaceLayout workspace_layout(int64_t num_groups, int64_t kernel_bytes = 0) {
  const int64_t g = num_groups;
  WorkspaceLayout l{};
  int64_t at = 0;
  auto take = [&at](int64_t bytes) {
    const int64_t here = at;
    at += align16(bytes);
    return here;
  };
  l.window = take(sizeof(WindowHeader));
  l.boundary = take((g + 1) * 8);
  for (GemmArraysLayout& set : l.gemm) {
    set.action = take(g * 4);
    set.problem = take(g * 3 * 4);
    for (int i = 0; i < 4; ++i) set.ptr[i] = take(g * 8);
    for (int i = 0; i < 4; ++i) set.ld[i] = take(g * 8);
  }
  l.kernel = take(kernel_bytes > 0 ? kernel_bytes + kKernelWorkspaceAlignment - 16 : 0);
  l.bytes = at;
  return l;
}

// The sm_90a kernel's workspace inside a workspace of `total_bytes` at `base`: aligned up
// to kKernelWorkspaceAlignment, with the bytes left after it (0 when none are).
struct KernelWorkspace {
  void* data;
  int64_t bytes;
};

GG_HD KernelWorkspace kernel_workspace(void* base, int64_t total_bytes, int64_t num_groups) {
  const int64_t start = workspace_layout(num_groups).kernel;
  const uintptr_t at = reinterpret_cast<uintptr_t>(static_cast<char*>(base) + start);
  const uintptr_t a = static_cast<uintptr_t>(kKernelWorkspaceAlignment);
  const uintptr_t aligned = (at + a - 1) / a * a;
  const int64_t used = start + static_cast<int64_t>(aligned - at);
  return {reinterpret_cast<void*>(aligned), total_bytes > used ? total_bytes - used : 0};
}

// Typed views of one set's arrays, and of the whole workspace.
struct GemmArrays {
  int32_t* action;
  int32_t* problem;
  void** ptr[4];
  int64_t* ld[4];
};

struct WorkspaceView {
  WindowHeader* window;
  int64_t* boundary;
  GemmArrays gemm[kGemmSets];
};

GG_HD WorkspaceView workspace_view(void* base, int64_t num_groups) {
  const WorkspaceLayout l = workspace_layout(num_groups);
  char* b = static_cast<char*>(base);
  WorkspaceView v{};
  v.window = reinterpret_cast<WindowHeader*>(b + l.window);
  v.boundary = reinterpret_cast<int64_t*>(b + l.boundary);
  for (int s = 0; s < kGemmSets; ++s) {
    v.gemm[s].action = reinterpret_cast<int32_t*>(b + l.gemm[s].action);
    v.gemm[s].problem = reinterpret_cast<int32_t*>(b + l.gemm[s].problem);
    for (int i = 0; i < 4; ++i) {
      v.gemm[s].ptr[i] = reinterpret_cast<void**>(b + l.gemm[s].ptr[i]);
      v.gemm[s].ld[i] = reinterpret_cast<int64_t*>(b + l.gemm[s].ld[i]);
    }
  }
  return v;
}

// The call's operand base pointers and element sizes. C may be null (no bias): it then
// points at D, which a GEMM with beta = 0 never reads.
struct GemmOperands {
  const void* a;
  const void* b;
  const void* c;
  void* d;
  int64_t a_bytes, b_bytes, c_bytes, d_bytes;  // element sizes
};

// Writes local group `local`'s entry. A group that is not a GEMM gets problem (0, 0, 0):
// the grouped GEMM gives it no tiles, so no k = 0 problem ever reaches it, and the setup
// kernel writes its rows instead. `action` records what the setup decided, for the core
// tests to read (no kernel reads it).
GG_HD void write_group(const GemmArrays& ws, int64_t local, const GroupProblem& p, const GemmOperands& ops) {
  const bool gemm = p.action == GroupAction::gemm;
  ws.action[local] = static_cast<int32_t>(p.action);
  ws.problem[3 * local + 0] = gemm ? static_cast<int32_t>(p.m) : 0;
  ws.problem[3 * local + 1] = gemm ? static_cast<int32_t>(p.n) : 0;
  ws.problem[3 * local + 2] = gemm ? static_cast<int32_t>(p.k) : 0;
  char* d = static_cast<char*>(ops.d) + p.d_offset * ops.d_bytes;
  ws.ptr[0][local] = const_cast<char*>(static_cast<const char*>(ops.a) + p.a_offset * ops.a_bytes);
  ws.ptr[1][local] = const_cast<char*>(static_cast<const char*>(ops.b) + p.b_offset * ops.b_bytes);
  ws.ptr[2][local] =
      ops.c ? const_cast<char*>(static_cast<const char*>(ops.c) + p.c_offset * ops.c_bytes) : d;
  ws.ptr[3][local] = d;
  ws.ld[0][local] = p.lda;
  ws.ld[1][local] = p.ldb;
  ws.ld[2][local] = ops.c ? p.ldc : p.ldd;
  ws.ld[3][local] = p.ldd;
}

}  // namespace groupgemm
