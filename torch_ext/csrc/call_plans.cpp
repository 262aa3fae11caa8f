// Call plans: the GEMM entry points with everything but the addresses fixed in advance, for
// the PyTorch frontend's eager path. A plan holds a call's shapes, dtypes, flags and device,
// which the frontend checked once and memoises by them; run() takes only the operands'
// addresses (0 for an absent optional one), the workspace and the stream, and calls the core
// without the GIL. The core checks again what it can see (dimensions, dtypes, null
// pointers); the extents behind the addresses are the frontend's to guarantee, which is why
// plans are built only from checked tensors of the plan's shapes.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>

#include "array_args.h"
#include "groupgemm/groupgemm.h"

namespace nb = nanobind;

namespace groupgemm {
namespace {

using array_args::run_core;

void* address(uintptr_t a) { return reinterpret_cast<void*>(a); }

// Where the plan's calls run: the CPU (device_index -1) or a CUDA device.
ExecContext context_of(int device_index, int64_t workspace_bytes) {
  ExecContext ctx;
  ctx.device = device_index < 0 ? Device::cpu : Device::cuda;
  ctx.device_index = device_index;
  ctx.workspace_bytes = workspace_bytes;
  return ctx;
}

IndexType index_type(int bits) {
  if (bits != 32 && bits != 64) throw nb::value_error("index arrays are int32 or int64");
  return bits == 32 ? IndexType::i32 : IndexType::i64;
}

// The group sizes (or cumulative ends) and the optional group_offset of a plan.
struct Groups {
  IndexArray sizes, offset;  // offset.count 0: absent
  Groups(int64_t sizes_count, int sizes_bits, bool group_ends, int offset_bits) {
    sizes = {nullptr, index_type(sizes_bits), sizes_count, group_ends};
    if (offset_bits) offset = {nullptr, index_type(offset_bits), 1};
  }
  template <typename Args>
  void place(Args& a, uintptr_t sizes_at, uintptr_t offset_at) const {
    a.group_sizes = sizes, a.group_sizes.data = address(sizes_at);
    a.group_offset = offset;
    if (offset.count) a.group_offset.data = address(offset_at);
  }
};

class MatmulPlan {
 public:
  MatmulPlan(int64_t m, int64_t k, int64_t n, int64_t num_groups, DType in_dtype, DType out_dtype,
             int64_t sizes_count, int sizes_bits, bool group_ends, int offset_bits, bool transpose_rhs,
             int device_index, int64_t workspace_bytes)
      : groups_(sizes_count, sizes_bits, group_ends, offset_bits),
        ctx_(context_of(device_index, workspace_bytes)) {
    args_.m = m, args_.k = k, args_.n = n, args_.num_groups = num_groups;
    args_.in_dtype = in_dtype, args_.out_dtype = out_dtype, args_.transpose_rhs = transpose_rhs;
  }

  void run(uintptr_t lhs, uintptr_t rhs, uintptr_t sizes, uintptr_t out, uintptr_t bias, uintptr_t offset,
           uintptr_t workspace, uintptr_t stream) const {
    MatmulArgs a = args_;
    a.lhs = address(lhs), a.rhs = address(rhs), a.out = address(out), a.bias = address(bias);
    groups_.place(a, sizes, offset);
    ExecContext ctx = ctx_;
    ctx.workspace = address(workspace), ctx.stream = address(stream);
    run_core([&] { return grouped_matmul(a, ctx); });
  }

 private:
  MatmulArgs args_;
  Groups groups_;
  ExecContext ctx_;
};

class BackwardPlan {
 public:
  BackwardPlan(int64_t m, int64_t k, int64_t n, int64_t num_groups, DType in_dtype, DType drhs_dtype,
               DType dbias_dtype, int64_t sizes_count, int sizes_bits, bool group_ends, int offset_bits,
               bool transpose_rhs, int device_index, int64_t workspace_bytes)
      : groups_(sizes_count, sizes_bits, group_ends, offset_bits),
        ctx_(context_of(device_index, workspace_bytes)) {
    args_.m = m, args_.k = k, args_.n = n, args_.num_groups = num_groups;
    args_.in_dtype = in_dtype, args_.drhs_dtype = drhs_dtype, args_.dbias_dtype = dbias_dtype;
    args_.transpose_rhs = transpose_rhs;
  }

  void run(uintptr_t lhs, uintptr_t rhs, uintptr_t grad, uintptr_t sizes, uintptr_t offset, uintptr_t dlhs,
           uintptr_t drhs, uintptr_t dbias, uintptr_t workspace, uintptr_t stream) const {
    BackwardArgs a = args_;
    a.lhs = address(lhs), a.rhs = address(rhs), a.grad = address(grad);
    a.dlhs = address(dlhs), a.drhs = address(drhs), a.dbias = address(dbias);
    groups_.place(a, sizes, offset);
    ExecContext ctx = ctx_;
    ctx.workspace = address(workspace), ctx.stream = address(stream);
    run_core([&] { return grouped_matmul_backward(a, ctx); });
  }

 private:
  BackwardArgs args_;
  Groups groups_;
  ExecContext ctx_;
};

}  // namespace

void bind_call_plans(nb::module_& m) {
  nb::enum_<DType>(m, "DType", "The core's float dtypes.")
      .value("float32", DType::f32)
      .value("bfloat16", DType::bf16)
      .value("float16", DType::f16)
      .value("float64", DType::f64);
  nb::class_<MatmulPlan>(m, "MatmulPlan",
                         "grouped_matmul with fixed shapes, dtypes, flags and device; run() takes addresses.")
      .def(nb::init<int64_t, int64_t, int64_t, int64_t, DType, DType, int64_t, int, bool, int, bool, int,
                    int64_t>(),
           nb::arg("m"), nb::arg("k"), nb::arg("n"), nb::arg("num_groups"), nb::arg("in_dtype"),
           nb::arg("out_dtype"), nb::arg("sizes_count"), nb::arg("sizes_bits"), nb::arg("group_ends"),
           nb::arg("offset_bits"), nb::arg("transpose_rhs"), nb::arg("device_index"),
           nb::arg("workspace_bytes"))
      .def("run", &MatmulPlan::run, nb::arg("lhs"), nb::arg("rhs"), nb::arg("group_sizes"), nb::arg("out"),
           nb::arg("bias"), nb::arg("group_offset"), nb::arg("workspace"), nb::arg("stream"));
  nb::class_<BackwardPlan>(m, "BackwardPlan",
                           "grouped_matmul_backward with fixed shapes, dtypes, flags and device; run() takes "
                           "addresses (0: a gradient not wanted).")
      .def(nb::init<int64_t, int64_t, int64_t, int64_t, DType, DType, DType, int64_t, int, bool, int, bool,
                    int, int64_t>(),
           nb::arg("m"), nb::arg("k"), nb::arg("n"), nb::arg("num_groups"), nb::arg("in_dtype"),
           nb::arg("drhs_dtype"), nb::arg("dbias_dtype"), nb::arg("sizes_count"), nb::arg("sizes_bits"),
           nb::arg("group_ends"), nb::arg("offset_bits"), nb::arg("transpose_rhs"), nb::arg("device_index"),
           nb::arg("workspace_bytes"))
      .def("run", &BackwardPlan::run, nb::arg("lhs"), nb::arg("rhs"), nb::arg("grad"), nb::arg("group_sizes"),
           nb::arg("group_offset"), nb::arg("dlhs"), nb::arg("drhs"), nb::arg("dbias"), nb::arg("workspace"),
           nb::arg("stream"));
}

}  // namespace groupgemm
