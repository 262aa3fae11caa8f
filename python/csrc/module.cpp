// groupgemm._core: what both frontends share (the build's CUDA facts, the Device,
// Activation and FP8 enums, workspace sizes), the core's array entry points (used by the
// PyTorch frontend's ops and the tests), the call plans of its eager path and, once
// registered by groupgemm.jax, its XLA FFI handlers. Both bindings are generated from one
// table of the ops (op_table.h; gemm_ops.cpp, expert_ops.cpp, fp8_ops.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <exception>
#include <string>

#include "arg_view.h"
#include "attribute_enums.h"
#include "groupgemm/fp8.h"
#include "groupgemm/fp8_blocks.h"
#include "groupgemm/groupgemm.h"

namespace nb = nanobind;

namespace groupgemm {
void bind_array_entry_points(nb::module_& m);
void bind_call_plans(nb::module_& m);
void bind_ffi_handlers(nb::module_& m);
}  // namespace groupgemm

// An enumerated attribute's type as an IntEnum: int(value) is what an op's attribute carries.
template <typename Enum>
void bind_enum(nb::module_& m) {
  using Table = groupgemm::glue::Enumerators<Enum>;
  nb::enum_<Enum> bound(m, Table::type_name, nb::is_arithmetic(), Table::doc);
  for (const groupgemm::glue::Enumerator& e : Table::values) bound.value(e.name, static_cast<Enum>(e.value), e.doc);
}

NB_MODULE(_core, m) {
  m.doc() = "groupgemm core: grouped GEMM for Mixture-of-Experts layers";
  // The eager path's call plans live as long as the process (a memo, and the autograd
  // nodes of tensors still alive at exit): at interpreter teardown nanobind would report
  // them as leaks on every run.
  nb::set_leak_warnings(false);
  // An argument the array entry points refuse: TypeError for a wrong dtype, else ValueError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const groupgemm::glue::ArgError& e) {
      PyErr_SetString(e.wrong_type ? PyExc_TypeError : PyExc_ValueError, e.what());
    }
  });
  m.def("cuda_compiled", &groupgemm::cuda_compiled, "True when the CUDA backend was compiled in.");
  m.def(
      "cuda_capture_record",
      [] {
        const groupgemm::CaptureRecord r = groupgemm::cuda_capture_record();
        nb::dict d;
        d["calls"] = r.calls, d["calls_under_capture"] = r.calls_under_capture;
        d["first_under_capture"] = r.first_under_capture;
        return d;
      },
      "The CUDA calls this process made on a stream, how many ran while their stream was capturing (a CUDA "
      "graph or an XLA command buffer being recorded) and whether the first did: a capture check's "
      "evidence.");
  m.def(
      "cuda_architectures", [] { return std::string(groupgemm::cuda_architectures()); },
      "The CUDA architectures compiled for, comma-separated (CMAKE_CUDA_ARCHITECTURES).");
  nb::enum_<groupgemm::Device>(m, "Device", "Where a call runs.")
      .value("cpu", groupgemm::Device::cpu)
      .value("cuda", groupgemm::Device::cuda);
  m.def("workspace_bytes", &groupgemm::grouped_matmul_workspace_bytes, nb::arg("device"),
        nb::arg("num_groups"), nb::arg("device_index") = -1,
        "Bytes of workspace one call with num_groups local groups needs on `device` (0 on the CPU); on "
        "CUDA for the GPU device_index (-1: the current device).");
  m.def("permute_workspace_bytes", &groupgemm::permute_workspace_bytes, nb::arg("device"),
        nb::arg("num_slots"), nb::arg("num_experts"),
        "Bytes of workspace permute needs on `device` for num_slots = T * k slots and num_experts experts "
        "(0 on the CPU).");
  m.def(
      "expert_mlp_workspace_bytes",
      [](groupgemm::Device device, int64_t num_slots, int64_t num_experts, int64_t hidden,
         int64_t in_features, int64_t kind, int64_t value_bytes, bool backward) {
        return groupgemm::expert_mlp_workspace_bytes(device, num_slots, num_experts, hidden, in_features,
                                                     static_cast<groupgemm::Activation>(kind), value_bytes,
                                                     backward);
      },
      nb::arg("device"), nb::arg("num_slots"), nb::arg("num_experts"), nb::arg("hidden"),
      nb::arg("in_features"), nb::arg("kind"), nb::arg("value_bytes"), nb::arg("backward"),
      "Bytes of workspace expert_mlp (backward=False) or its backward needs on `device` for num_slots = "
      "T * k slots, num_experts local experts, H = hidden, F_in = in_features, the activation `kind` "
      "(Activation's value) and values of value_bytes bytes each (0 on the CPU).");
  m.def("unpermute_backward_workspace_bytes", &groupgemm::unpermute_backward_workspace_bytes,
        nb::arg("device"), nb::arg("num_slots"),
        "Bytes of workspace unpermute_backward needs on `device` to compute dpermuted for num_slots = T * k "
        "slots (0 on the CPU).");
  bind_enum<groupgemm::Activation>(m);
  bind_enum<groupgemm::Fp8Type>(m);
  bind_enum<groupgemm::Fp8Scaling>(m);
  nb::enum_<groupgemm::Fp8Call>(m, "Fp8Call", "An FP8 entry point, for fp8_workspace_bytes.")
      .value("matmul", groupgemm::Fp8Call::matmul)
      .value("wgrad", groupgemm::Fp8Call::wgrad)
      .value("quantize_grouped", groupgemm::Fp8Call::quantize_grouped);
  m.def(
      "fp8_workspace_bytes", &groupgemm::fp8_workspace_bytes, nb::arg("device"), nb::arg("call"),
      nb::arg("scaling"), nb::arg("num_groups"), nb::arg("m"), nb::arg("k"), nb::arg("n"),
      nb::arg("device_index") = -1,
      "Bytes of workspace an FP8 call needs on `device` (0 on the CPU); (m, k, n) as groupgemm/fp8.h says.");
  m.def("fp8_token_block_bound", &groupgemm::token_block_bound, nb::arg("m"), nb::arg("num_groups"),
        "Scale rows of the blockwise weight gradient: floor((m + 127 G) / 128).");
  groupgemm::bind_array_entry_points(m);
  groupgemm::bind_call_plans(m);
  groupgemm::bind_ffi_handlers(m);
}
