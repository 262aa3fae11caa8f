// CUTLASS 3.x pointer-array grouped GEMM for sm_90a (TMA loads, WGMMA, persistent
// warp-specialized kernels, cooperative or ping-pong by tile; CUTLASS example 57) with the
// problem shapes only in device memory:
// the setup kernel's int32 (m, n, k) array is the kernel's GroupProblemShape array, and
// its int64 leading-dimension arrays are the kernel's stride arrays (each 3.x stride here
// holds exactly one run-time int64, the leading dimension; checked below). No host copy
// of the problems is passed (host_problem_shapes = nullptr), so the host never reads them.
//
// Deterministic: the default group tile scheduler (no stream-K, no split-K) gives each
// output tile to one CTA, which runs its whole K loop (a cluster's CTAs share loads, not
// tiles). Groups with a 0 x 0 x 0 problem have no tiles, so the scheduler skips them and
// no k = 0 problem reaches the mainloop.
//
// Only compiled for sm_90a (a separate object library in CMakeLists.txt).
#pragma once

#include <algorithm>
#include <string>

#include "cute/tensor.hpp"
#include "cutlass/bfloat16.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/half.h"
#include "cutlass_layouts.h"
#include "gemm_sm90.h"
#include "kernel_attributes.h"
#include "sm90_strides.h"

namespace groupgemm {
namespace cuda {

using Sm90ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

// The workspace's problem array is int32 (m, n, k) per group (workspace.h).
static_assert(sizeof(Sm90ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int32_t) &&
                  alignof(Sm90ProblemShape::UnderlyingProblemShape) == alignof(int32_t),
              "GroupProblemShape's per-group shape is not three packed int32");

// A workspace ld array is an array of Stride when Stride is one int64 (the leading
// dimension) in mode `ld_mode` (sm90_strides.h) plus compile-time 1 and 0 modes, which
// take no storage.
template <typename Stride, int ld_mode>
constexpr bool is_one_ld_stride() {
  using Ld = cute::remove_cvref_t<decltype(cute::get<ld_mode>(Stride{}))>;
  using Unit = cute::remove_cvref_t<decltype(cute::get<1 - ld_mode>(Stride{}))>;
  using Batch = cute::remove_cvref_t<decltype(cute::get<2>(Stride{}))>;
  return sizeof(Stride) == sizeof(int64_t) && cute::is_same_v<Ld, int64_t> &&
         cute::is_same_v<Unit, cute::Int<1>> && cute::is_same_v<Batch, cute::Int<0>>;
}

// A workspace pointer array (void*[G]) as the element pointer array CUTLASS takes.
template <typename Ptr>
Ptr* device_array(void** array) {
  return static_cast<Ptr*>(static_cast<void*>(array));
}

// Dynamic shared memory a block may opt into on compute capability 9.0 (227 KB).
constexpr size_t kSm90SharedMemoryPerBlock = 232448;

// The schedules a tile names in hopper_kernels.def.
struct Sm90Schedule_cooperative {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Sm90Schedule_pingpong {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// Each tile's shapes and schedules, from its GG_SM90_TILE row.
template <Sm90Tile Tile>
struct Sm90TileConfig;

#define GG_SM90_TILE(name, schedule, tile_m, tile_n, tile_k, cluster_m, cluster_n)                           \
  template <>                                                                                                \
  struct Sm90TileConfig<Sm90Tile::name> {                                                                    \
    using TileShape = cute::Shape<cute::Int<tile_m>, cute::Int<tile_n>, cute::Int<tile_k>>;                  \
    using ClusterShape = cute::Shape<cute::Int<cluster_m>, cute::Int<cluster_n>, cute::_1>;                 \
    using KernelSchedule = Sm90Schedule_##schedule::Kernel;                                                  \
    using EpilogueSchedule = Sm90Schedule_##schedule::Epilogue;                                              \
  };
#include "hopper_kernels.def"

// The CUTLASS element type of a 16-bit DType.
template <DType D>
struct Sm90Element;
template <>
struct Sm90Element<DType::bf16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct Sm90Element<DType::f16> {
  using type = cutlass::half_t;
};

// What the epilogue adds to the accumulator: beta * C with C of the output type
// (linear: C = D when accumulating or onto pre-written bias rows), or each group's bias row
// broadcast over its rows (bias_row: read through the workspace's C pointers, one row per
// group, in the input type). The bias never goes through C itself: C is loaded with TMA,
// whose descriptors cannot have the zero row stride of a broadcast.
enum class Sm90Epilogue : int { linear = 0, bias_row = 1 };

template <typename In, typename Out, typename TileShape, Sm90Epilogue E>
struct Sm90EpilogueOp {
  using type = cutlass::epilogue::fusion::LinearCombination<Out, float, Out, float>;
};

template <typename In, typename Out, typename TileShape>
struct Sm90EpilogueOp<In, Out, TileShape, Sm90Epilogue::bias_row> {
  // D = acc + bias[g] in float32, rounded once to Out; the row pointer comes from the
  // group's entry of a pointer array (batch stride 0).
  using type = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, Out, float, cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch,
      cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, In*, float, cute::Stride<cute::_0, cute::_1, int64_t>,
                                                  128 / cutlass::sizeof_bits<In>::value>>;
};

template <typename In, typename Out, GemmLayout L, Sm90Tile Tile, Sm90Epilogue E = Sm90Epilogue::linear>
struct Sm90Gemm {
  using Layouts = OperandLayouts<L>;
  using Config = Sm90TileConfig<Tile>;
  static constexpr int kInAlignment = 128 / cutlass::sizeof_bits<In>::value;
  static constexpr int kOutAlignment = 128 / cutlass::sizeof_bits<Out>::value;
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;
  using KernelSchedule = typename Config::KernelSchedule;
  using EpilogueSchedule = typename Config::EpilogueSchedule;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Out, cutlass::layout::RowMajor*,
      kOutAlignment, Out, cutlass::layout::RowMajor*, kOutAlignment, EpilogueSchedule,
      typename Sm90EpilogueOp<In, Out, TileShape, E>::type>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, In, typename Layouts::A*, kInAlignment, In,
      typename Layouts::B*, kInAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Sm90ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  // The pointer-array kernels do not check this themselves: a kernel over the limit would
  // compile and fail only at launch. (The ping-pong tile's float32 outputs use all of it.)
  static_assert(Kernel::SharedStorageSize <= kSm90SharedMemoryPerBlock,
                "an sm90 kernel needs more shared memory than a Hopper block has");

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  static_assert(is_one_ld_stride<StrideA, sm90_ld_mode(L, Sm90Operand::a)>() &&
                    is_one_ld_stride<StrideB, sm90_ld_mode(L, Sm90Operand::b)>() &&
                    is_one_ld_stride<StrideC, sm90_ld_mode(L, Sm90Operand::c)>() &&
                    is_one_ld_stride<StrideD, sm90_ld_mode(L, Sm90Operand::d)>(),
                "a CUTLASS 3.x stride is not the workspace's int64 leading dimension");

  static typename Gemm::Arguments arguments(const Sm90Launch& s) {
    const GroupedGemmLaunch& l = s.gemm;
    // The persistent grid is sized from the SM count in whole clusters (CUTLASS assumes
    // 18-SM GPCs unless told the active cluster count); a count that is not a multiple of
    // the cluster size, as on a partitioned GPU, could give a grid the cluster launch refuses.
    constexpr int cluster_size = cute::size(ClusterShape{});
    cutlass::KernelHardwareInfo hw{l.device.device, l.device.sm_count / cluster_size * cluster_size};
    // With the bias in the epilogue, C is D (same pointers and strides, never loaded: the
    // epilogue has no C term) and the C pointer array holds the bias rows.
    constexpr bool bias = E == Sm90Epilogue::bias_row;
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {l.num_groups,
                                   reinterpret_cast<typename Sm90ProblemShape::UnderlyingProblemShape*>(
                                       const_cast<int32_t*>(l.problems)),
                                   nullptr},
                                  {device_array<const In*>(l.ptr[0]), reinterpret_cast<StrideA*>(l.ld[0]),
                                   device_array<const In*>(l.ptr[1]), reinterpret_cast<StrideB*>(l.ld[1])},
                                  {{},
                                   device_array<const Out*>(l.ptr[bias ? 3 : 2]),
                                   reinterpret_cast<StrideC*>(l.ld[bias ? 3 : 2]),
                                   device_array<Out*>(l.ptr[3]),
                                   reinterpret_cast<StrideD*>(l.ld[3])},
                                  hw};
    if constexpr (bias) {
      args.epilogue.thread = {{}, {device_array<const In*>(l.ptr[2]), In(0), {}}, {}};
    } else {
      args.epilogue.thread.alpha = 1.0f;
      args.epilogue.thread.beta = l.beta();
    }
    return args;
  }

  static size_t workspace_bytes(int sm_count) {
    Sm90Launch s{};
    s.gemm.device.sm_count = sm_count;
    s.gemm.num_groups = 1;
    return Gemm::get_workspace_size(arguments(s));
  }

  static Status run(const Sm90Launch& s) {
    const typename Gemm::Arguments args = arguments(s);
    if (Gemm::get_workspace_size(args) > s.kernel_workspace_bytes)
      return Status::Internal("the sm90 grouped GEMM needs more workspace than workspace_bytes gave");
    Gemm gemm;
    static KernelAttributesOnce attributes;
    const int device = s.gemm.device.device;
    cutlass::Status st = Gemm::can_implement(args);
    if (st == cutlass::Status::kSuccess) {
      if (attributes.needed(device)) {
        st = gemm.initialize(args, s.kernel_workspace, s.gemm.stream);
      } else {
        st = Kernel::initialize_workspace(args, s.kernel_workspace, s.gemm.stream);
        if (st == cutlass::Status::kSuccess) st = gemm.update(args, s.kernel_workspace);
      }
    }
    if (st == cutlass::Status::kSuccess) {
      attributes.done(device);
      st = gemm.run(s.gemm.stream);
    }
    if (st != cutlass::Status::kSuccess)
      return Status::Internal(std::string("CUTLASS sm90 grouped GEMM failed: ") +
                              cutlass::cutlassGetStatusString(st));
    return Status::Ok();
  }
};

template <DType InType, Sm90Tile Tile, GemmLayout L>
Status grouped_gemm_sm90_for(const Sm90Launch& s) {
  using In = typename Sm90Element<InType>::type;
  if (s.gemm.out_dtype == DType::f32) return Sm90Gemm<In, float, L, Tile>::run(s);
  if constexpr (L != GemmLayout::col_row)  // a forward's bias; a weight gradient has none
    if (s.gemm.c == GemmC::bias_row) return Sm90Gemm<In, In, L, Tile, Sm90Epilogue::bias_row>::run(s);
  return Sm90Gemm<In, In, L, Tile>::run(s);
}

template <DType InType, Sm90Tile Tile, GemmLayout L>
size_t sm90_workspace_bytes_for(int sm_count) {
  using In = typename Sm90Element<InType>::type;
  size_t most = std::max(Sm90Gemm<In, In, L, Tile>::workspace_bytes(sm_count),
                         Sm90Gemm<In, float, L, Tile>::workspace_bytes(sm_count));
  if constexpr (L != GemmLayout::col_row)
    most = std::max(most, Sm90Gemm<In, In, L, Tile, Sm90Epilogue::bias_row>::workspace_bytes(sm_count));
  return most;
}

}  // namespace cuda
}  // namespace groupgemm
