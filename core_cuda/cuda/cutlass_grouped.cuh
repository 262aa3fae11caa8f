// CUTLASS 2.x GemmGrouped with device-only scheduling: every thread block walks the
// problem sizes in device memory itself, so nothing about the groups is read on the host.
// Deterministic: one thread block owns each output tile and runs its whole K loop (no
// split-K, no atomics).
#pragma once

#include <atomic>
#include <string>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_grouped.h"
#include "cutlass/gemm/kernel/default_gemm_grouped.h"
#include "cutlass_layouts.h"
#include "grouped_gemm.h"
#include "kernel_attributes.h"

namespace groupgemm {
namespace cuda {

// 16-bit inputs: Ampere tensor-core MMA (also what sm_90a runs for this 2.x kernel),
// fp32 accumulation, 16-byte operand accesses.
template <typename In, typename Out>
struct TensorOpConfig {
  using OperatorClass = cutlass::arch::OpClassTensorOp;
  using Threadblock = cutlass::gemm::GemmShape<128, 128, 32>;
  using Warp = cutlass::gemm::GemmShape<64, 64, 32>;
  using Instruction = cutlass::gemm::GemmShape<16, 8, 16>;
  static constexpr int kStages = 4;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<In>::value;
  static constexpr int kOutAlignment = 128 / cutlass::sizeof_bits<Out>::value;
};

// float32: CUDA-core FMA in exact fp32 (tensor cores would round inputs to TF32).
struct SimtF32Config {
  using OperatorClass = cutlass::arch::OpClassSimt;
  using Threadblock = cutlass::gemm::GemmShape<128, 128, 8>;
  using Warp = cutlass::gemm::GemmShape<32, 64, 8>;
  using Instruction = cutlass::gemm::GemmShape<1, 1, 1>;
  static constexpr int kStages = 3;
  static constexpr int kAlignment = 1;
  static constexpr int kOutAlignment = 1;
};

// Each input dtype's configurations, for a float32 output and for an output in the input's
// own dtype: the one place the 2.x grouped and gathered GEMMs take them from.
template <typename In>
struct ConfigsFor {
  using F32Out = TensorOpConfig<In, float>;
  using SameOut = TensorOpConfig<In, In>;
};
template <>
struct ConfigsFor<float> {
  using F32Out = SimtF32Config;
  using SameOut = SimtF32Config;
};

// The workspace stores each problem as int32 (m, n, k) (workspace.h); CUTLASS reads
// the same bytes as GemmCoord.
static_assert(sizeof(cutlass::gemm::GemmCoord) == 3 * sizeof(int32_t) && cutlass::gemm::GemmCoord::kM == 0 &&
                  cutlass::gemm::GemmCoord::kN == 1 && cutlass::gemm::GemmCoord::kK == 2,
              "GemmCoord is not int32 (m, n, k)");

template <typename In, typename Out, GemmLayout L, typename Config>
Status run_cutlass_grouped(const GroupedGemmLaunch& l) {
  using Epilogue = cutlass::epilogue::thread::LinearCombination<Out, Config::kOutAlignment, float, float>;
  using Kernel = typename cutlass::gemm::kernel::DefaultGemmGrouped<
      In, typename OperandLayouts<L>::A, cutlass::ComplexTransform::kNone, Config::kAlignment, In,
      typename OperandLayouts<L>::B, cutlass::ComplexTransform::kNone, Config::kAlignment, Out,
      cutlass::layout::RowMajor, float, typename Config::OperatorClass, cutlass::arch::Sm80,
      typename Config::Threadblock, typename Config::Warp, typename Config::Instruction, Epilogue,
      cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, Config::kStages,
      cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmGrouped<Kernel>;

  // One full wave of persistent thread blocks; each finds its tiles on the device.
  // Blocks per SM is a property of the kernel: query the occupancy API once, not on
  // every call (the grid size only affects speed; device-only scheduling is correct
  // for any).
  static std::atomic<int> cached_per_sm{0};
  int per_sm = cached_per_sm.load(std::memory_order_relaxed);
  if (per_sm <= 0) {
    per_sm = Gemm::maximum_active_blocks();
    if (per_sm <= 0) return Status::Internal("the grouped GEMM kernel does not fit on this device");
    cached_per_sm.store(per_sm, std::memory_order_relaxed);
  }

  typename Gemm::Arguments args(reinterpret_cast<cutlass::gemm::GemmCoord*>(const_cast<int32_t*>(l.problems)),
                                l.num_groups, l.device.sm_count * per_sm, typename Epilogue::Params(1.0f, l.beta()),
                                reinterpret_cast<In**>(l.ptr[0]), reinterpret_cast<In**>(l.ptr[1]),
                                reinterpret_cast<Out**>(l.ptr[2]), reinterpret_cast<Out**>(l.ptr[3]), l.ld[0],
                                l.ld[1], l.ld[2], l.ld[3]);
  Gemm gemm;
  static KernelAttributesOnce attributes;
  cutlass::Status s = attributes.needed(l.device.device) ? gemm.initialize(args, nullptr, l.stream)
                                                         : gemm.update(args, nullptr, l.stream);
  if (s == cutlass::Status::kSuccess) {
    attributes.done(l.device.device);
    s = gemm.run(l.stream);
  }
  if (s != cutlass::Status::kSuccess)
    return Status::Internal(std::string("CUTLASS grouped GEMM failed: ") +
                            cutlass::cutlassGetStatusString(s));
  return Status::Ok();
}

// Dispatches on the output dtype and the layout for one input type.
template <typename In>
Status run_for_input(const GroupedGemmLaunch& l) {
  auto by_layout = [&](auto out_tag, auto config_tag) {
    using Out = decltype(out_tag);
    using Config = decltype(config_tag);
    switch (l.layout) {
      case GemmLayout::row_row: return run_cutlass_grouped<In, Out, GemmLayout::row_row, Config>(l);
      case GemmLayout::row_col: return run_cutlass_grouped<In, Out, GemmLayout::row_col, Config>(l);
      case GemmLayout::col_row: return run_cutlass_grouped<In, Out, GemmLayout::col_row, Config>(l);
    }
    return Status::Internal("unknown GEMM layout");
  };
  if (l.out_dtype == DType::f32) return by_layout(float{}, typename ConfigsFor<In>::F32Out{});
  return by_layout(In{}, typename ConfigsFor<In>::SameOut{});
}

}  // namespace cuda
}  // namespace groupgemm
