#include "float_mode.h"

#include <omp.h>

#include "run_time_libraries.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace groupgemm {
namespace {

#if defined(__x86_64__) || defined(__i386__)
constexpr unsigned kFlushBits = 0x8040;  // MXCSR: FTZ (bit 15), DAZ (bit 6)
unsigned read_mode() { return _mm_getcsr(); }
void write_mode(unsigned mode) { _mm_setcsr(mode); }
#elif defined(__aarch64__)
constexpr unsigned kFlushBits = 1u << 24;  // FPCR.FZ
unsigned read_mode() { return static_cast<unsigned>(__builtin_aarch64_get_fpcr()); }
void write_mode(unsigned mode) { __builtin_aarch64_set_fpcr(mode); }
#else
constexpr unsigned kFlushBits = 0;
unsigned read_mode() { return 0; }
void write_mode(unsigned) {}
#endif

// Sets the core's mode; returns the mode it found.
unsigned enter_core_mode() {
  const unsigned found = read_mode();
  if (found & kFlushBits) write_mode(found & ~kFlushBits);
  return found;
}

thread_local CpuFloatModeScope* current = nullptr;

void set_worker(void* data) {
  auto& workers = *static_cast<std::vector<CpuFloatModeScope::Worker>*>(data);
  const size_t i = static_cast<size_t>(omp_get_thread_num());
  if (i < workers.size()) workers[i] = {std::this_thread::get_id(), enter_core_mode()};
}

void restore_worker(void* data) {
  for (const auto& w : *static_cast<const std::vector<CpuFloatModeScope::Worker>*>(data))
    if (w.thread == std::this_thread::get_id()) write_mode(w.found);
}

}  // namespace

CpuFloatModeScope::CpuFloatModeScope() : outer_(current == nullptr) {
  if (!outer_) return;
  saved_ = enter_core_mode();
  current = this;
}

CpuFloatModeScope::~CpuFloatModeScope() {
  if (!outer_) return;
  current = nullptr;
  if (workers_set) cpu::parallel_region(restore_worker, &workers);
  write_mode(saved_);  // the calling thread last: the workers' restore ran on it too
}

namespace cpu {
void before_parallel_work() {
  CpuFloatModeScope* scope = current;
  if (scope == nullptr || scope->workers_set) return;
  scope->workers_set = true;
  // Entries a smaller team leaves unset name no thread: the restore passes them by.
  scope->workers.assign(static_cast<size_t>(omp_get_max_threads()), {std::thread::id(), 0});
  // Workers this region starts copy the calling thread's mode: the caller's, so that they
  // find it and are put back to it, as if the caller's own first parallel work had started
  // them (they kept the core's, and the caller's later flushing work did not flush on them).
  // set_worker gives the calling thread, the team's first, the core's mode back.
  write_mode(scope->caller_mode());
  cpu::parallel_region(set_worker, &scope->workers);
}
}  // namespace cpu

}  // namespace groupgemm
