// groupgemm._core: what both frontends share (the build's CUDA facts, the Device enum,
// workspace sizes), the core's array entry points (used by the PyTorch frontend and the
// tests) and, once registered by groupgemm.jax, its XLA FFI handlers.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "groupgemm/groupgemm.h"

namespace nb = nanobind;

namespace groupgemm {
void bind_array_entry_points(nb::module_& m);
void bind_ffi_handlers(nb::module_& m);
}  // namespace groupgemm

NB_MODULE(_core, m) {
  m.doc() = "groupgemm core: grouped GEMM for Mixture-of-Experts layers";
  m.def("cuda_compiled", &groupgemm::cuda_compiled, "True when the CUDA backend was compiled in.");
  m.def(
      "cuda_architectures",
      [] { return std::string(groupgemm::cuda_compiled() ? GROUPGEMM_CUDA_ARCHS : ""); },
      "The CUDA architectures compiled for, comma-separated (CMAKE_CUDA_ARCHITECTURES).");
  nb::enum_<groupgemm::Device>(m, "Device", "Where a call runs.")
      .value("cpu", groupgemm::Device::cpu)
      .value("cuda", groupgemm::Device::cuda);
  m.def("workspace_bytes", &groupgemm::grouped_matmul_workspace_bytes, nb::arg("device"),
        nb::arg("num_groups"),
        "Bytes of workspace one call with num_groups local groups needs on `device` (0 on the CPU).");
  groupgemm::bind_array_entry_points(m);
  groupgemm::bind_ffi_handlers(m);
}
