// The floating-point mode the core's CPU backend computes in: IEEE 754, subnormals kept
// (x86's MXCSR with flush-to-zero and denormals-are-zero clear; AArch64's FPCR with FZ
// clear). Callers come in with their own mode: XLA's CPU threads flush subnormals, torch's
// do not, and OpenMP's worker threads keep the mode of whichever thread first started them.
// So each CPU call sets this mode on its calling thread and, before its first parallel
// work, on the OpenMP workers it will use, and puts back what it found when it returns:
// the same inputs give the same bits whoever calls. The CUDA kernels are compiled without
// -ftz (nvcc's default), so their arithmetic keeps subnormals too.
#pragma once

#include <thread>
#include <vector>

namespace groupgemm {

// Sets the core's mode on the calling thread for its lifetime; one per CPU entry point
// (arg_checks.h's dispatch). A scope inside another on the same thread is the outer one's.
class CpuFloatModeScope {
 public:
  CpuFloatModeScope();
  ~CpuFloatModeScope();
  CpuFloatModeScope(const CpuFloatModeScope&) = delete;
  CpuFloatModeScope& operator=(const CpuFloatModeScope&) = delete;

  // The workers' threads and the modes they had, once before_parallel_work set them.
  struct Worker {
    std::thread::id thread;
    unsigned found;
  };
  bool workers_set = false;
  std::vector<Worker> workers;
  // The calling thread's mode as the scope found it.
  unsigned caller_mode() const { return saved_; }

 private:
  bool outer_;
  unsigned saved_ = 0;
};

namespace cpu {
// Before work that may run on OpenMP's workers (a parallel region of the core, a oneDNN
// call): gives them the core's mode for the rest of the calling thread's scope, once per
// scope. Nothing to do outside a scope, or on a worker.
void before_parallel_work();
}  // namespace cpu

}  // namespace groupgemm
