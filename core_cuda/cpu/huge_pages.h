// Transparent huge pages for large outputs.
//
// A freshly allocated buffer (a new gradient every training step: allocators hand
// large blocks straight from mmap) costs a page fault per 4 KiB on its first write,
// and those faults can take longer than the GEMM that writes it; 2 MiB pages need 512
// times fewer (docs/backends.md has the measured difference). Asking for huge pages
// before the first write is advice only: it never changes the contents, and where the
// kernel declines (THP off, a file mapping) nothing happens. Only blocks of
// kMinBytes and more are advised. glibc serves every block of 32 MB and more with a
// mapping of its own (its mmap threshold never rises past 32 MB), which goes away when the
// block is freed; a smaller block can come from its heap, and advising it splits the
// heap's mapping (the fused expert MLP's benchmark steps kept 1-5 more mappings, a steady
// count, and no more resident memory). The threshold was 64 MB, then 32 MB: at 32 the fused
// expert MLP's float32 pre-activation and fc1 weight gradient (50 MB each at H = 1024,
// F = 384, 16384 routed rows) are advised, and its JAX forward+backward took 2-3% less time;
// at 16 its bfloat16 pre-activation (24 MB, fresh from XLA every step: 6.3k page faults a
// step, 0.5k advised) is too, and its JAX bfloat16 forward+backward took 3-4% less time. The
// composition's, and PyTorch's cells (whose allocator hands that block back from the heap),
// did not move (each measured interleaved in one process; docs/benchmarks.md).
#pragma once

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace groupgemm {
namespace cpu {

inline void advise_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
  constexpr int64_t kMinBytes = int64_t(16) << 20;
  if (bytes < kMinBytes) return;
  // Only whole huge pages inside the buffer: the advice covers no one else's memory.
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + uintptr_t(bytes)) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data, (void)bytes;
#endif
}

}  // namespace cpu
}  // namespace groupgemm
