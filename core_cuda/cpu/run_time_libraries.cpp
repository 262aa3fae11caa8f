#include "run_time_libraries.h"

#include <dlfcn.h>
#include <omp.h>

#include <cstdio>
#include <cstdlib>

#include "float_mode.h"

namespace groupgemm {
namespace cpu {

void* run_time_function(const char* soname, const char* name) {
  // RTLD_LOCAL: a library the package loaded is found by its soname and comes back as it
  // is; one loaded here keeps its symbols out of the process's global scope (libdnnl's
  // C++ standard-library instantiations would take the place of another library's).
  void* library = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
  void* function = library ? dlsym(library, name) : nullptr;
  if (!function) {
    std::fprintf(stderr, "groupgemm: cannot reach %s in %s (%s); import groupgemm, which loads it first\n", name,
                 soname, dlerror());
    std::abort();
  }
  return function;
}

}  // namespace cpu
}  // namespace groupgemm

// The GNU OpenMP entry points the compiler emits for the core's `#pragma omp` regions and
// the omp_* calls it makes, forwarded to libgomp.so.1 (their signatures are libgomp's
// libgomp_g.h and omp.h). They are local to libgroupgemm_core.so (its export map): other
// libraries' OpenMP calls never come here. A pragma that needs another entry point is an
// undefined symbol at the core's link: add it here. A region that may run on workers first
// gives them the core's floating-point mode (float_mode.h).
#define GG_OPENMP(name) GG_RUN_TIME_FUNCTION(::groupgemm::cpu::kOpenmpLibrary, name)

extern "C" {
void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);
void GOMP_barrier(void);
bool GOMP_loop_nonmonotonic_dynamic_start(long start, long end, long incr, long chunk, long* istart, long* iend);
bool GOMP_loop_nonmonotonic_dynamic_next(long* istart, long* iend);
void GOMP_loop_end(void);
void GOMP_loop_end_nowait(void);
bool GOMP_loop_ordered_static_start(long start, long end, long incr, long chunk, long* istart, long* iend);
bool GOMP_loop_ordered_static_next(long* istart, long* iend);
void GOMP_ordered_start(void);
void GOMP_ordered_end(void);

void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) {
  if (num_threads != 1) groupgemm::cpu::before_parallel_work();  // 1: an `if` clause kept it serial
  GG_OPENMP(GOMP_parallel)(fn, data, num_threads, flags);
}
void GOMP_barrier(void) { GG_OPENMP(GOMP_barrier)(); }
bool GOMP_loop_nonmonotonic_dynamic_start(long start, long end, long incr, long chunk, long* istart, long* iend) {
  return GG_OPENMP(GOMP_loop_nonmonotonic_dynamic_start)(start, end, incr, chunk, istart, iend);
}
bool GOMP_loop_nonmonotonic_dynamic_next(long* istart, long* iend) {
  return GG_OPENMP(GOMP_loop_nonmonotonic_dynamic_next)(istart, iend);
}
void GOMP_loop_end(void) { GG_OPENMP(GOMP_loop_end)(); }
void GOMP_loop_end_nowait(void) { GG_OPENMP(GOMP_loop_end_nowait)(); }
bool GOMP_loop_ordered_static_start(long start, long end, long incr, long chunk, long* istart, long* iend) {
  return GG_OPENMP(GOMP_loop_ordered_static_start)(start, end, incr, chunk, istart, iend);
}
bool GOMP_loop_ordered_static_next(long* istart, long* iend) {
  return GG_OPENMP(GOMP_loop_ordered_static_next)(istart, iend);
}
void GOMP_ordered_start(void) { GG_OPENMP(GOMP_ordered_start)(); }
void GOMP_ordered_end(void) { GG_OPENMP(GOMP_ordered_end)(); }

int omp_get_max_threads(void) __GOMP_NOTHROW { return GG_OPENMP(omp_get_max_threads)(); }
int omp_get_num_threads(void) __GOMP_NOTHROW { return GG_OPENMP(omp_get_num_threads)(); }
int omp_get_thread_num(void) __GOMP_NOTHROW { return GG_OPENMP(omp_get_thread_num)(); }
int omp_in_parallel(void) __GOMP_NOTHROW { return GG_OPENMP(omp_in_parallel)(); }
void omp_set_num_threads(int n) __GOMP_NOTHROW { GG_OPENMP(omp_set_num_threads)(n); }
}

void groupgemm::cpu::parallel_region(void (*fn)(void*), void* data) { GG_OPENMP(GOMP_parallel)(fn, data, 0, 0); }
