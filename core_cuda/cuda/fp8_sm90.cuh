// CUTLASS 3.x FP8 grouped GEMM with blockwise scaling for sm_90a (TMA loads, FP8 WGMMA,
// the persistent cooperative warp-specialized kernel; CUTLASS example 68), with the
// problem shapes, pointers and strides only in device memory, written by the setup kernels
// (setup.h, fp8_workspace.h); no host copy of the problems (host_problem_shapes = nullptr).
//
// Accumulation: the FP8 WGMMA accumulator is promoted every 128 of K (one k-tile, four
// 32-deep WGMMAs): the tile's partial sums are multiplied by their two scales and added to
// float32 accumulators (CUTLASS's GmmaFP8Accumulation), the remedy for Hopper's limited
// FP8 accumulation precision that DeepSeek-V3 describes. The scales are one per row of A
// and one per row of B (column of D) for each 128-block of K: a single granularity serves
// both recipes and both GEMM forms, the caller laying the API's scales out so
// (rowwise scales repeated along K, a 128 x 128 weight block's scale repeated over its
// 128 rows).
//
// Deterministic: the default group tile scheduler (no stream-K, no split-K) gives each
// output tile to one CTA, which runs its whole K loop. Groups with a 0 x 0 x 0 problem
// have no tiles, so no k = 0 problem reaches the mainloop.
//
// Only compiled for sm_90a (the FP8 units of CMakeLists.txt's sm90 object library).
#pragma once

#include <string>

#include "cute/tensor.hpp"
#include "cutlass/bfloat16.h"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/float8.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "fp8_sm90.h"
#include "kernel_attributes.h"

namespace groupgemm {
namespace cuda {

using Fp8ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
static_assert(sizeof(Fp8ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int32_t),
              "GroupProblemShape's per-group shape is not three packed int32");

template <Fp8Type T>
struct Fp8Element;
template <>
struct Fp8Element<Fp8Type::e4m3> {
  using type = cutlass::float_e4m3_t;
};
template <>
struct Fp8Element<Fp8Type::e5m2> {
  using type = cutlass::float_e5m2_t;
};

template <DType D>
struct Fp8Output;
template <>
struct Fp8Output<DType::bf16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct Fp8Output<DType::f32> {
  using type = float;
};

// A Stride whose only storage is the int64 leading dimension of mode 0 (with 1 and 0 for
// the other modes): the workspace's ld arrays are arrays of it.
template <typename Stride>
constexpr bool is_mode0_ld_stride() {
  using Ld = cute::remove_cvref_t<decltype(cute::get<0>(Stride{}))>;
  using Unit = cute::remove_cvref_t<decltype(cute::get<1>(Stride{}))>;
  using Batch = cute::remove_cvref_t<decltype(cute::get<2>(Stride{}))>;
  return sizeof(Stride) == sizeof(int64_t) && cute::is_same_v<Ld, int64_t> &&
         cute::is_same_v<Unit, cute::Int<1>> && cute::is_same_v<Batch, cute::Int<0>>;
}

// A workspace pointer array (void*[G]) as the element pointer array CUTLASS takes.
template <typename Ptr>
Ptr* pointer_array(void** array) {
  return static_cast<Ptr*>(static_cast<void*>(array));
}

template <Fp8Type Lhs, DType OutType>
struct Fp8Sm90Gemm {
  using ElementA = typename Fp8Element<Lhs>::type;
  using ElementB = cutlass::float_e4m3_t;
  using Out = typename Fp8Output<OutType>::type;
  using LayoutA = cutlass::layout::RowMajor;     // [m, k]: K-major
  using LayoutB = cutlass::layout::ColumnMajor;  // [k, n] column-major = [n, k] row-major: K-major
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentIn = 16;  // 16 bytes of float8
  static constexpr int kAlignmentOut = 128 / cutlass::sizeof_bits<Out>::value;

  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  // One scale per row of A, per row of B, per 128 of K.
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Out, LayoutD*, kAlignmentOut, Out,
      LayoutD*, kAlignmentOut, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<Out, float, Out, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>,
      kAlignmentIn, ElementB, cute::tuple<LayoutB*, LayoutSFB*>, kAlignmentIn, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Fp8ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  static_assert(is_mode0_ld_stride<StrideA>() && is_mode0_ld_stride<StrideB>() &&
                    is_mode0_ld_stride<StrideC>() && is_mode0_ld_stride<StrideD>(),
                "a CUTLASS 3.x stride is not the workspace's int64 leading dimension");
  // The grouped mainloop derives each group's scale layout from its problem shape, M-major
  // ([k / 128][m] and [k / 128][n], packed): what the FP8 setup writes.
  static_assert(Mainloop::ScaleMsPerTile == 128 && Mainloop::ScaleNsPerTile == 128,
                "one scale per row of A and of B");

  static typename Gemm::Arguments arguments(const Fp8GemmLaunch& l) {
    cutlass::KernelHardwareInfo hw{l.device.device, l.device.sm_count};
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {l.num_groups,
         reinterpret_cast<typename Fp8ProblemShape::UnderlyingProblemShape*>(
             const_cast<int32_t*>(l.problems)),
         nullptr},
        // The scale layouts are not read: the grouped mainloop derives each group's from its
        // problem shape.
        {pointer_array<const ElementA*>(l.ptr[0]), reinterpret_cast<StrideA*>(l.ld[0]),
         pointer_array<const ElementB*>(l.ptr[1]), reinterpret_cast<StrideB*>(l.ld[1]), l.scale[0], nullptr,
         l.scale[1], nullptr},
        {{},
         pointer_array<const Out*>(l.ptr[2]),
         reinterpret_cast<StrideC*>(l.ld[2]),
         pointer_array<Out*>(l.ptr[3]),
         reinterpret_cast<StrideD*>(l.ld[3])},
        hw};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = l.beta;
    return args;
  }

  static size_t workspace_bytes(int sm_count) {
    Fp8GemmLaunch l{};
    l.device.sm_count = sm_count;
    l.num_groups = 1;
    return Gemm::get_workspace_size(arguments(l));
  }

  static Status run(const Fp8GemmLaunch& l) {
    const typename Gemm::Arguments args = arguments(l);
    if (Gemm::get_workspace_size(args) > l.kernel_workspace_bytes)
      return Status::Internal("the FP8 grouped GEMM needs more workspace than fp8_workspace_bytes gave");
    Gemm gemm;
    // The kernel's shared-memory attribute is set once per device (kernel_attributes.h).
    static KernelAttributesOnce attributes;
    const int device = l.device.device;
    cutlass::Status st = Gemm::can_implement(args);
    if (st == cutlass::Status::kSuccess) {
      if (attributes.needed(device)) {
        st = gemm.initialize(args, l.kernel_workspace, l.stream);
      } else {
        st = Kernel::initialize_workspace(args, l.kernel_workspace, l.stream);
        if (st == cutlass::Status::kSuccess) st = gemm.update(args, l.kernel_workspace);
      }
    }
    if (st == cutlass::Status::kSuccess) {
      attributes.done(device);
      st = gemm.run(l.stream);
    }
    if (st != cutlass::Status::kSuccess)
      return Status::Internal(std::string("CUTLASS FP8 grouped GEMM failed: ") +
                              cutlass::cutlassGetStatusString(st));
    return Status::Ok();
  }
};

template <Fp8Type Lhs, DType Out>
Status fp8_grouped_gemm_sm90_for(const Fp8GemmLaunch& launch) {
  return Fp8Sm90Gemm<Lhs, Out>::run(launch);
}

template <Fp8Type Lhs, DType Out>
size_t fp8_sm90_workspace_bytes_for(int sm_count) {
  return Fp8Sm90Gemm<Lhs, Out>::workspace_bytes(sm_count);
}

}  // namespace cuda
}  // namespace groupgemm
