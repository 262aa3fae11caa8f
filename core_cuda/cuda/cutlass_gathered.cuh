// The gathered grouped GEMM on CUTLASS 2.x: GemmGrouped's device-only scheduling (every
// thread block walks the problem sizes in device memory, so nothing about the groups is
// read on the host) around DefaultGemm's mainloop built with its GatherA / GatherB flag, whose
// operand iterator reads row (or contraction) index i of a group from the group's index
// array. CUTLASS's GemmGrouped kernel builds its iterators without indices, hence this
// kernel: the same pieces, each group's index pointer handed to the gathered iterator.
//
// A row-major A gathers its rows (M); a column-major A or a row-major B gathers its
// contraction (K): CUTLASS's iterator replaces the strided coordinate of its pitch-linear
// view, which is K for those two. Deterministic: one thread block owns each output tile and
// runs its whole K loop (no split-K, no atomics).
#pragma once

#include <atomic>
#include <string>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/gemm/device/default_gemm_configuration.h"
#include "cutlass/gemm/kernel/default_gemm.h"
#include "cutlass/gemm/kernel/gemm_grouped_problem_visitor.h"
#include "cutlass_grouped.cuh"
#include "gathered_gemm.h"
#include "kernels.h"

namespace groupgemm {
namespace cuda {

template <typename Mma_, typename Epilogue_, Gather kGather>
struct GatheredGroupedGemm {
  using Mma = Mma_;
  using Epilogue = Epilogue_;
  using OutputOp = typename Epilogue::OutputOp;
  using ElementA = typename Mma::IteratorA::Element;
  using LayoutA = typename Mma::IteratorA::Layout;
  using ElementB = typename Mma::IteratorB::Element;
  using LayoutB = typename Mma::IteratorB::Layout;
  using ElementC = typename Epilogue::OutputTileIterator::Element;
  using LayoutC = typename Epilogue::OutputTileIterator::Layout;
  static constexpr int kThreadCount = 32 * Mma::WarpCount::kCount;
  using ProblemVisitor =
      cutlass::gemm::kernel::GemmGroupedProblemVisitor<typename Mma::Shape,
                                                       cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly,
                                                       kThreadCount, kThreadCount>;

  struct Params {
    typename ProblemVisitor::Params problems;
    typename OutputOp::Params output_op;
    void* const* ptr[4];       // A, B, C, D per group
    const int64_t* ld[4];      // their leading dimensions
    const int32_t* const* indices;  // the gathered operand's indices per group
  };

  struct SharedStorage {
    union {
      typename Mma::SharedStorage main_loop;
      typename Epilogue::SharedStorage epilogue;
    } kernel;
    typename ProblemVisitor::SharedStorage problem_visitor;  // not overlapped: read between tiles
  };

  CUTLASS_DEVICE void operator()(const Params& params, SharedStorage& shared) {
    ProblemVisitor visitor(params.problems, shared.problem_visitor, blockIdx.x);
    const int thread = threadIdx.x, warp = cutlass::canonical_warp_idx_sync(), lane = threadIdx.x % 32;
    while (visitor.next_tile()) {
      const cutlass::gemm::GemmCoord size = visitor.problem_size();
      const int32_t g = visitor.problem_index();
      const int32_t tile = visitor.threadblock_idx();
      const cutlass::gemm::GemmCoord grid = visitor.grid_shape(size);
      const int m0 = int(tile / grid.n()) * Mma::Shape::kM, n0 = int(tile % grid.n()) * Mma::Shape::kN;
      const int32_t* indices = params.indices[g];
      constexpr bool kGatherA = kGather == Gather::a_rows || kGather == Gather::a_k;

      using IteratorA = typename Mma::IteratorA;
      using IteratorB = typename Mma::IteratorB;
      IteratorA iterator_a(typename IteratorA::Params(LayoutA(params.ld[0][g])),
                           static_cast<ElementA*>(params.ptr[0][g]), {size.m(), size.k()}, thread, {m0, 0},
                           kGatherA ? indices : nullptr);
      IteratorB iterator_b(typename IteratorB::Params(LayoutB(params.ld[1][g])),
                           static_cast<ElementB*>(params.ptr[1][g]), {size.k(), size.n()}, thread, {0, n0},
                           kGather == Gather::b_k ? indices : nullptr);
      typename Mma::FragmentC accumulators;
      accumulators.clear();
      Mma mma(shared.kernel.main_loop, thread, warp, lane);
      __syncthreads();  // the previous tile's epilogue is done with the shared storage
      const int k_tiles = (size.k() + Mma::Shape::kK - 1) / Mma::Shape::kK;
      mma(k_tiles, accumulators, iterator_a, iterator_b, accumulators);

      const OutputOp output_op(params.output_op);
      using OutputIterator = typename Epilogue::OutputTileIterator;
      OutputIterator source(typename OutputIterator::Params(LayoutC(params.ld[2][g])),
                            static_cast<ElementC*>(params.ptr[2][g]), size.mn(), thread, {m0, n0});
      OutputIterator destination(typename OutputIterator::Params(LayoutC(params.ld[3][g])),
                                 static_cast<ElementC*>(params.ptr[3][g]), size.mn(), thread, {m0, n0});
      Epilogue epilogue(shared.kernel.epilogue, thread, warp, lane);
      epilogue(output_op, destination, accumulators, source);
      visitor.advance(gridDim.x);
    }
  }
};

// The gathered kernel of one input type, output type, operand layout, gathered operand and
// tile configuration (cutlass_grouped.cuh's), launched as one persistent wave.
template <typename In, typename Out, GemmLayout L, Gather kGather, typename Config>
Status run_cutlass_gathered(const GatheredGemmLaunch& l) {
  using Epilogue = cutlass::epilogue::thread::LinearCombination<Out, Config::kOutAlignment, float, float>;
  using Operator = typename cutlass::gemm::device::DefaultGemmConfiguration<
      typename Config::OperatorClass, cutlass::arch::Sm80, In, In, Out, float>::Operator;
  using LayoutA = typename OperandLayouts<L>::A;
  using LayoutB = typename OperandLayouts<L>::B;
  using Default = cutlass::gemm::kernel::DefaultGemm<
      In, LayoutA, Config::kAlignment, In, LayoutB, Config::kAlignment, Out, cutlass::layout::RowMajor, float,
      typename Config::OperatorClass, cutlass::arch::Sm80,
      typename Config::Threadblock, typename Config::Warp, typename Config::Instruction, Epilogue,
      cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, Config::kStages, false, Operator,
      cutlass::gemm::SharedMemoryClearOption::kNone, kGather == Gather::a_rows || kGather == Gather::a_k,
      kGather == Gather::b_k>;
  using Kernel = GatheredGroupedGemm<typename Default::Mma, typename Default::Epilogue, kGather>;
  constexpr int kSharedBytes = int(sizeof(typename Kernel::SharedStorage));

  // Blocks per SM is a property of the kernel: found once (and the shared-memory limit set
  // once per device), not on every call.
  static std::atomic<int> cached_per_sm{0};
  static KernelAttributesOnce attributes;
  if (attributes.needed(l.gemm.device.device)) {
    const auto attribute = cudaFuncAttributeMaxDynamicSharedMemorySize;
    if (kSharedBytes >= (48 << 10) &&
        cudaFuncSetAttribute(cutlass::Kernel<Kernel>, attribute, kSharedBytes) != cudaSuccess)
      return Status::Internal(std::string("the gathered grouped GEMM's shared memory: ") +
                              cudaGetErrorString(cudaGetLastError()));
    attributes.done(l.gemm.device.device);
  }
  int per_sm = cached_per_sm.load(std::memory_order_relaxed);
  if (per_sm <= 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, cutlass::Kernel<Kernel>, Kernel::kThreadCount,
                                                      kSharedBytes) != cudaSuccess ||
        per_sm <= 0) {
      cudaGetLastError();
      return Status::Internal("the gathered grouped GEMM kernel does not fit on this device");
    }
    cached_per_sm.store(per_sm, std::memory_order_relaxed);
  }

  typename Kernel::Params params{};
  params.problems = typename Kernel::ProblemVisitor::Params(
      reinterpret_cast<cutlass::gemm::GemmCoord*>(const_cast<int32_t*>(l.gemm.problems)), l.gemm.num_groups,
      nullptr, 0);
  params.output_op = typename Epilogue::Params(1.0f, l.gemm.beta());
  for (int i = 0; i < 4; ++i) params.ptr[i] = l.gemm.ptr[i], params.ld[i] = l.gemm.ld[i];
  params.indices = l.indices;
  const int blocks = l.gemm.device.sm_count * per_sm;  // one persistent wave
  cutlass::Kernel<Kernel><<<blocks, Kernel::kThreadCount, kSharedBytes, l.gemm.stream>>>(params);
  return last_launch("the gathered grouped GEMM");
}

// Dispatches on the layout and the gathered operand: A's rows with either forward layout
// (the output in In or float32), the contraction of a weight gradient (the output in In).
template <typename In>
Status run_gathered_for_input(const GatheredGemmLaunch& l) {
  using ConfigF32Out = typename ConfigsFor<In>::F32Out;
  using ConfigSameOut = typename ConfigsFor<In>::SameOut;
  const bool wide = l.gemm.out_dtype == DType::f32 && !std::is_same_v<In, float>;
  switch (l.gather) {
    case Gather::a_rows:
      if (l.gemm.layout == GemmLayout::row_row)
        return wide ? run_cutlass_gathered<In, float, GemmLayout::row_row, Gather::a_rows, ConfigF32Out>(l)
                    : run_cutlass_gathered<In, In, GemmLayout::row_row, Gather::a_rows, ConfigSameOut>(l);
      if (l.gemm.layout == GemmLayout::row_col)
        return wide ? run_cutlass_gathered<In, float, GemmLayout::row_col, Gather::a_rows, ConfigF32Out>(l)
                    : run_cutlass_gathered<In, In, GemmLayout::row_col, Gather::a_rows, ConfigSameOut>(l);
      break;
    case Gather::a_k:
      if (l.gemm.layout == GemmLayout::col_row && !wide)
        return run_cutlass_gathered<In, In, GemmLayout::col_row, Gather::a_k, ConfigSameOut>(l);
      break;
    case Gather::b_k:
      if (l.gemm.layout == GemmLayout::col_row && !wide)
        return run_cutlass_gathered<In, In, GemmLayout::col_row, Gather::b_k, ConfigSameOut>(l);
      break;
    case Gather::none: break;
  }
  return Status::Internal("no gathered GEMM kernel for this layout, gather and output dtype");
}

}  // namespace cuda
}  // namespace groupgemm
