// The CPU libraries the core calls, reached at run time by soname rather than linked:
// oneDNN (libdnnl.so.3) and OpenBLAS (libscipy_openblas.so) from their Python wheels, and
// the GNU OpenMP runtime (libgomp.so.1) that oneDNN's build threads itself with.
//
// Why: libgroupgemm_core.so then names no shared library outside the manylinux policy, so
// the redistributable wheel carries neither a copy of these libraries nor a dependency
// on where their wheels put them. The package loads them before the core (groupgemm/_libs.py),
// so each soname below finds the copy already in the process: the core, oneDNN and the
// frameworks share one OpenMP runtime (torch's own libgomp.so.1, when torch came first).
#pragma once

namespace groupgemm {
namespace cpu {

constexpr const char* kOnednnLibrary = "libdnnl.so.3";
constexpr const char* kOpenblasLibrary = "libscipy_openblas.so";
constexpr const char* kOpenmpLibrary = "libgomp.so.1";

// `name` from the library `soname`, loaded on first use. A library or function that
// cannot be found ends the process with a message naming both: the package loads every
// library at import (an ImportError there if one is missing), so only a program that
// links the core without the package's set-up can get here.
void* run_time_function(const char* soname, const char* name);

// fn(data) on each thread of a parallel region over OpenMP's default team, made in libgomp
// directly: without the core's own GOMP_parallel, which first sets the workers' mode.
void parallel_region(void (*fn)(void*), void* data);

}  // namespace cpu
}  // namespace groupgemm

// A call site's pointer to the library function `name`, declared by the library's own
// header and resolved once per call site.
#define GG_RUN_TIME_FUNCTION(soname, name)                                                              \
  ([] {                                                                                                 \
    static const auto function = reinterpret_cast<decltype(&::name)>(                                    \
        ::groupgemm::cpu::run_time_function(soname, #name));                                            \
    return function;                                                                                    \
  }())
