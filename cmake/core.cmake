# The framework-free core (core_cuda/): its CPU libraries, its CUDA backend when nvcc is
# found, and groupgemm_core_library(name STATIC|SHARED), which builds it. Included by
# CMakeLists.txt wherever the core is compiled; a Python module linked against a core
# built earlier (GROUPGEMM_PREBUILT_CORE) needs none of this.

# The CPU GEMM libraries come from Python wheels (onednn-cpu-gomp + its devel headers,
# scipy-openblas32); locate them through the installed distributions so isolated and
# non-isolated builds both work. The core compiles against their headers and reaches the
# libraries at run time (core_cuda/cpu/run_time_libraries.h): it links none of them.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "
import importlib.metadata as md, os
def find(dist, suffix):
    for f in md.distribution(dist).files:
        if str(f).endswith(suffix):
            return os.path.realpath(md.distribution(dist).locate_file(f))
    raise SystemExit(f'{dist} has no {suffix}')
hpp = find('onednn-devel-cpu-gomp', 'oneapi/dnnl/dnnl.hpp')
import scipy_openblas32 as ob
print(os.path.dirname(os.path.dirname(os.path.dirname(hpp))), find('onednn-cpu-gomp', 'libdnnl.so.3'),
      ob.get_include_dir(), os.path.join(ob.get_lib_dir(), 'libscipy_openblas.so'), sep=';', end='')"
  OUTPUT_VARIABLE GG_DEPS RESULT_VARIABLE GG_DEPS_RESULT)
if(NOT GG_DEPS_RESULT EQUAL 0)
  message(FATAL_ERROR "oneDNN / OpenBLAS wheels not found: pip install onednn-devel-cpu-gomp scipy-openblas32")
endif()
# The CPU backend runs small groups side by side with OpenMP: the same GNU OpenMP
# runtime that the onednn-cpu-gomp build threads itself with, also reached at run time.
find_package(OpenMP REQUIRED COMPONENTS CXX)
if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  message(FATAL_ERROR "the core's OpenMP calls go to GNU OpenMP (libgomp.so.1): build it with GCC")
endif()

list(GET GG_DEPS 0 ONEDNN_INCLUDE_DIR)
list(GET GG_DEPS 1 ONEDNN_LIBRARY)
list(GET GG_DEPS 2 OPENBLAS_INCLUDE_DIR)
list(GET GG_DEPS 3 OPENBLAS_LIBRARY)
# Where a program linking the core finds those libraries without the package's set-up
# (the core tests).
get_filename_component(ONEDNN_LIBRARY_DIR "${ONEDNN_LIBRARY}" DIRECTORY)
get_filename_component(OPENBLAS_LIBRARY_DIR "${OPENBLAS_LIBRARY}" DIRECTORY)

set(GG_CORE_SOURCES
  core_cuda/src/api.cpp
  core_cuda/cpu/backend.cpp
  core_cuda/cpu/gemm.cpp
  core_cuda/cpu/gemm_onednn.cpp
  core_cuda/cpu/expert_ops.cpp
  core_cuda/src/expert_mlp_api.cpp
  core_cuda/cpu/expert_mlp.cpp
  core_cuda/cpu/row_scratch.cpp
  core_cuda/src/fp8_api.cpp
  core_cuda/cpu/fp8_quantize.cpp
  core_cuda/cpu/fp8_gemm.cpp
  core_cuda/cpu/run_time_libraries.cpp
  core_cuda/cpu/float_mode.cpp)

# CUDA: compiled when nvcc is present (CUDACXX, PATH, or the default toolkit location)
# and GROUPGEMM_CUDA is not OFF. The build says which it made and why.
set(GG_WITH_CUDA OFF)
set(GG_CUDA_REASON "GROUPGEMM_CUDA=OFF")
if(GROUPGEMM_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  set(GG_CUDA_REASON "no nvcc found (set CUDACXX, or put nvcc on PATH)")
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
      # sm_80 machine code and its PTX, which the driver compiles for GPUs newer than any
      # listed here (sm_100, sm_120: the CUTLASS 2.x kernels run there), and sm_90a machine
      # code; sm_90a PTX would only ever run on sm_90a, which has the machine code.
      set(CMAKE_CUDA_ARCHITECTURES 80 90a-real)
    endif()
    enable_language(CUDA)
    set(GG_WITH_CUDA ON)
    # CUTLASS headers from the pinned nvidia-cutlass wheel: a build requirement of isolated
    # builds (python/build_backend.py); installed with --no-deps by ./dev.sh otherwise.
    execute_process(
      COMMAND "${Python_EXECUTABLE}" -c "
import importlib.metadata as md, os
d = md.distribution('nvidia-cutlass')
h = next(f for f in d.files if str(f).endswith('cutlass_library/source/include/cutlass/cutlass.h'))
print(os.path.dirname(os.path.dirname(os.path.realpath(d.locate_file(h)))), end='')"
      OUTPUT_VARIABLE CUTLASS_INCLUDE_DIR RESULT_VARIABLE GG_CUTLASS_RESULT ERROR_QUIET)
    if(NOT GG_CUTLASS_RESULT EQUAL 0)
      message(FATAL_ERROR "nvcc was found but the CUTLASS headers were not: "
                          "pip install --no-deps nvidia-cutlass==4.2.0.0, or build without CUDA with "
                          "GROUPGEMM_CUDA=OFF in the environment")
    endif()
    string(REPLACE ";" " " GG_ARCH_LIST "${CMAKE_CUDA_ARCHITECTURES}")
    set(GG_CUDA_REASON "nvcc ${CMAKE_CUDA_COMPILER_VERSION} at ${CMAKE_CUDA_COMPILER}, architectures ${GG_ARCH_LIST}, CUTLASS headers from ${CUTLASS_INCLUDE_DIR}")
  endif()
endif()
if(GG_WITH_CUDA)
  message(STATUS "groupgemm: building the CPU and CUDA backends: ${GG_CUDA_REASON}")
else()
  message(STATUS "groupgemm: building the CPU backend only: ${GG_CUDA_REASON}")
endif()

# The sm_90a kernels (CUTLASS 3.x: TMA + WGMMA), when the architectures include 90a: they
# exist only as sm_90a code, so their translation units compile for that target alone, once
# for every core library. One unit per 16-bit input dtype (every tile of the Hopper kernel
# table in every operand layout, and the gathered GEMM) and one for FP8: each unit's compile
# is mostly the CUTLASS headers and shared templates, so fewer, larger units take a third of
# the CPU time (gemm_sm90_dispatch.cu and fp8_sm90_dispatch.cu call each instantiation).
if(GG_WITH_CUDA AND CMAKE_CUDA_ARCHITECTURES MATCHES "(^|;)90a")
  set(GG_SM90_UNITS core_cuda/cuda/fp8_sm90_instances.cu)
  foreach(SM90_DTYPE bf16 f16)
    set(unit "${CMAKE_CURRENT_BINARY_DIR}/sm90/sm90_${SM90_DTYPE}.cu")
    configure_file(core_cuda/cuda/sm90_instances.cu.in "${unit}" @ONLY)
    list(APPEND GG_SM90_UNITS "${unit}")
  endforeach()
  add_library(groupgemm_gemm_sm90 OBJECT ${GG_SM90_UNITS})
  target_include_directories(groupgemm_gemm_sm90 PRIVATE core_cuda/include core_cuda/src core_cuda/cuda)
  target_include_directories(groupgemm_gemm_sm90 SYSTEM PRIVATE ${CUTLASS_INCLUDE_DIR})
  target_compile_options(groupgemm_gemm_sm90 PRIVATE -Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror)
  set_target_properties(groupgemm_gemm_sm90 PROPERTIES CUDA_ARCHITECTURES 90a-real CUDA_RUNTIME_LIBRARY Static)
endif()

function(groupgemm_core_library name type)
  add_library(${name} ${type} ${GG_CORE_SOURCES})
  # core_cuda/include is the public API; core_cuda/src holds the headers the backends share.
  target_include_directories(${name} PUBLIC core_cuda/include PRIVATE core_cuda/src)
  target_include_directories(${name} PRIVATE ${ONEDNN_INCLUDE_DIR} ${OPENBLAS_INCLUDE_DIR})
  # OpenMP's flags for the compiler only: its runtime is reached through run_time_libraries.cpp.
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${OpenMP_CXX_FLAGS}>)
  target_link_libraries(${name} PRIVATE ${CMAKE_DL_LIBS})
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror>
                                         $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Wall,-Wextra,-Werror>)
  if(NOT GG_WITH_CUDA)
    target_sources(${name} PRIVATE core_cuda/src/no_cuda.cpp)
  else()
    # The CUTLASS units first: a clean build starts the longest compiles early, so that on a
    # few cores none is left running alone at the end.
    target_sources(${name} PRIVATE
      core_cuda/cuda/grouped_gemm_instances.cu core_cuda/cuda/gathered_gemm_instances.cu
      core_cuda/cuda/backend.cu core_cuda/cuda/device_info.cu core_cuda/cuda/setup.cu
      core_cuda/cuda/bias_grad.cu core_cuda/cuda/gemm_unaligned.cu core_cuda/cuda/expert_backend.cu
      core_cuda/cuda/permute.cu core_cuda/cuda/unpermute.cu core_cuda/cuda/activation.cu core_cuda/cuda/router.cu
      core_cuda/cuda/expert_mlp.cu core_cuda/cuda/expert_mlp_kernels.cu core_cuda/cuda/gathered_gemm_unaligned.cu)
    target_sources(${name} PRIVATE core_cuda/cuda/gemm_sm90_dispatch.cu)
    target_sources(${name} PRIVATE core_cuda/cuda/fp8_backend.cu core_cuda/cuda/fp8_setup.cu
      core_cuda/cuda/fp8_quantize.cu core_cuda/cuda/fp8_sm90_dispatch.cu)
    if(TARGET groupgemm_gemm_sm90)
      target_sources(${name} PRIVATE $<TARGET_OBJECTS:groupgemm_gemm_sm90>)
      target_compile_definitions(${name} PRIVATE GROUPGEMM_WITH_SM90)
    endif()
    target_include_directories(${name} SYSTEM PRIVATE ${CUTLASS_INCLUDE_DIR})
    target_compile_definitions(${name} PRIVATE GROUPGEMM_WITH_CUDA)
    set_target_properties(${name} PROPERTIES CUDA_RUNTIME_LIBRARY Static
                                             CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES}")
  endif()
  # What cuda_architectures() reports (the fatbinary test reads it).
  string(REPLACE ";" "," archs "${CMAKE_CUDA_ARCHITECTURES}")
  target_compile_definitions(${name} PRIVATE GROUPGEMM_CUDA_ARCHS="${archs}")
endfunction()

