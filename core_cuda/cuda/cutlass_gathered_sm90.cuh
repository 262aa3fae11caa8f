// The gathered grouped GEMM on sm_90a: WGMMA from shared memory, fed by cp.async loads
// that read one operand through each group's index array, so token rows enter the GEMM
// where they are, never as a [T*k, H] copy: A's rows in a forward layout (fc1, fc2's input
// gradient), or the contraction's rows of A or B in a weight gradient's (w_in's gradient,
// col_row: both operands [K, M] / [K, N], M and N contiguous). TMA cannot gather (a
// descriptor covers one strided box), hence cp.async, as in CUTLASS's Hopper gather/scatter
// example; the consumer half is CUTLASS 3.x's cp.async warp-specialized cooperative
// mainloop (one producer warp group loads, two consumer warp groups share each 128 x 128
// output tile), the loads are written here: the collective's own take one strided tensor.
//
// Persistent over the groups' tiles with the problem sizes only on the device: block b
// takes tiles b, b + gridDim.x, ... and finds each one's group (gathered_tiles.h). A group
// with k = 0 writes beta * C and runs no mainloop (the collective needs a k tile).
// Deterministic: one block owns each output tile and its whole K loop.
//
// Only compiled for sm_90a (a unit of the sm90 object library in cmake/core.cmake).
#pragma once

#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/default_epilogue.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/pipeline/pipeline.hpp"
#include "cutlass_layouts.h"
#include "cutlass_sm90.cuh"
#include "gathered_gemm.h"
#include "gathered_tiles.h"
#include "kernel_attributes.h"
#include "kernels.h"

namespace groupgemm {
namespace cuda {

// One 16-byte cp.async into shared memory; `bytes` (0 to 16) are read from `src`, the
// rest of the 16 are zero-filled, so a row or column past the problem's edge is a zero
// (an unread garbage value could be a NaN that a zero weight does not cancel).
CUTLASS_DEVICE void copy_16_bytes(void* shared_dst, const void* src, int bytes) {
#if defined(__CUDA_ARCH__)
  const uint32_t dst = cute::cast_smem_ptr_to_uint(shared_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
#endif
}

template <typename In, typename Out, GemmLayout L, Gather kGather>
struct GatheredGroupedGemmSm90 {
  static_assert(kGather == Gather::a_rows ? L == GemmLayout::row_row || L == GemmLayout::row_col
                                          : (kGather == Gather::a_k || kGather == Gather::b_k) && L == GemmLayout::col_row,
                "A's rows are gathered in a forward layout, the contraction's rows in a weight gradient's");
  static constexpr int kTileM = 128, kTileN = 128, kTileK = 64;
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>;
  static constexpr int kElementBytes = int(sizeof(In));
  static constexpr int kVector = 16 / kElementBytes;  // elements per 16-byte copy
  static constexpr bool kAColMajor = L == GemmLayout::col_row;   // A [K, M]: M contiguous; else [M, K]
  static constexpr bool kBRowMajor = L != GemmLayout::row_col;   // B [K, N]: N contiguous; else [N, K]

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, In, typename OperandLayouts<L>::A, kVector, In,
      typename OperandLayouts<L>::B, kVector, float, TileShape, cute::Shape<cute::_1, cute::_1, cute::_1>,
      cutlass::gemm::collective::StageCountAuto, cutlass::gemm::KernelCpAsyncWarpSpecializedCooperative>::CollectiveOp;
  using TiledMma = typename Mainloop::TiledMma;
  using Pipeline = typename Mainloop::MainloopPipeline;
  using PipelineState = typename Mainloop::PipelineState;

  using StrideCD = cute::Stride<int64_t, cute::_1, int64_t>;
  using Epilogue = cutlass::epilogue::collective::DefaultEpilogue<
      Out, StrideCD, StrideCD, cutlass::epilogue::thread::LinearCombination<Out, 1, float, float>,
      cutlass::gemm::EpilogueDefault>;

  static constexpr int kLoadThreads = cutlass::NumThreadsPerWarpGroup;
  static constexpr int kMmaThreads = int(cute::size(TiledMma{}));
  static constexpr uint32_t MaxThreadsPerBlock = kLoadThreads + kMmaThreads;
  static constexpr uint32_t MinBlocksPerMultiprocessor = 1;

  // Each operand tile's 16-byte pieces over the load warp group (gathered_tiles.h).
  using PiecesA = TilePieces<kAColMajor ? kTileM : kTileK, kAColMajor ? kTileK : kTileM, kVector, kLoadThreads>;
  using PiecesB = TilePieces<kBRowMajor ? kTileN : kTileK, kBRowMajor ? kTileK : kTileN, kVector, kLoadThreads>;

  // A piece is one 16-byte cp.async, so its values must be contiguous and 16-byte aligned in
  // the shared-memory layout too. GMMA's layouts swizzle whole 16-byte units; checked over
  // one swizzle period (8 rows) of each tile. kAlongFirst: the layout's first mode (M or
  // N) is the pieces' contiguous one.
  template <typename Layout, typename Pieces, bool kAlongFirst>
  static constexpr bool pieces_contiguous() {
    const auto at = [](int i, int j) { return int(kAlongFirst ? Layout{}(j, i, 0) : Layout{}(i, j, 0)); };
    for (int r = 0; r < 8 && r < Pieces::kTileRows; ++r)
      for (int c = 0; c < Pieces::kTileCols; c += kVector) {
        if (at(r, c) % kVector != 0) return false;
        for (int v = 1; v < kVector; ++v)
          if (at(r, c + v) != at(r, c) + v) return false;
      }
    return true;
  }
  static_assert(pieces_contiguous<typename Mainloop::SmemLayoutA, PiecesA, kAColMajor>() &&
                    pieces_contiguous<typename Mainloop::SmemLayoutB, PiecesB, kBRowMajor>(),
                "a 16-byte piece is not contiguous in the mainloop's shared-memory layout");

  struct Params {
    const int32_t* problems;
    int num_groups;
    void* const* ptr[4];             // A, B, C, D per group
    const int64_t* ld[4];            // their leading dimensions
    const int32_t* const* indices;   // the gathered operand's rows per group
    float beta;
  };

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));
  static_assert(kSharedBytes <= int(kSm90SharedMemoryPerBlock), "the gathered sm90 kernel needs too much shared memory");

  // The storage rows (storage_row) of a thread's tile rows in `rows`, one per pass.
  template <typename Pieces>
  CUTLASS_DEVICE static void tile_rows(TileSpan rows, const int32_t* indices, int thread, int64_t* out) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < Pieces::kPasses; ++i) out[i] = storage_row(rows, Pieces::row(thread, i), indices);
  }

  // A thread's pieces of one operand tile of a k tile, into `stage` of `smem` (indexed (m or n,
  // k, stage)): tile rows along K find their storage rows now, the others take them from
  // tile_rows' `rows`.
  template <typename Pieces, bool kRowsAlongK, typename Smem>
  CUTLASS_DEVICE static void load_pieces(Smem& smem, int stage, const In* base, int64_t ld, TileSpans spans,
                                         const int32_t* indices, const int64_t* rows, int thread) {
    const int col = Pieces::col(thread);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < Pieces::kPasses; ++i) {
      const int r = Pieces::row(thread, i);
      int64_t row;
      void* dst;
      if constexpr (kRowsAlongK)
        row = storage_row(spans.rows, r, indices), dst = &smem(col, r, stage);
      else
        row = rows[i], dst = &smem(r, col, stage);
      const int bytes = piece_bytes_at(row, spans.cols, col, kElementBytes);
      copy_16_bytes(dst, bytes ? base + row * ld + spans.cols.first + col : base, bytes);
    }
  }

  // The load warp group: every k tile of each of the block's tiles into the pipeline.
  CUTLASS_DEVICE static void load(const Params& p, Pipeline& pipeline, SharedStorage& shared, int thread) {
    using namespace cute;
    Tensor sA = make_tensor(make_smem_ptr(shared.tensors.smem_A.data()), typename Mainloop::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared.tensors.smem_B.data()), typename Mainloop::SmemLayoutB{});
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    GroupTileWalker<kTileM, kTileN> walker(p.problems, p.num_groups);
    GatheredTile t;
    for (int64_t tile = blockIdx.x; walker.find(tile, t); tile += gridDim.x) {
      const In* a = static_cast<const In*>(p.ptr[0][t.group]);
      const In* b = static_cast<const In*>(p.ptr[1][t.group]);
      const int64_t lda = p.ld[0][t.group], ldb = p.ld[1][t.group];
      const int32_t* indices = p.indices[t.group];
      const int32_t* a_indices = kGather == Gather::b_k ? nullptr : indices;
      const int32_t* b_indices = kGather == Gather::b_k ? indices : nullptr;
      // The storage rows of tile rows along M or N (A [M, K], B [N, K]) for the whole tile:
      // a gathered index array is read once, not per k tile.
      int64_t a_row[kAColMajor ? 1 : PiecesA::kPasses], b_row[kBRowMajor ? 1 : PiecesB::kPasses];
      if constexpr (!kAColMajor) tile_rows<PiecesA>(a_tile_spans(false, t, 0).rows, a_indices, thread, a_row);
      if constexpr (!kBRowMajor) tile_rows<PiecesB>(b_tile_spans(false, t, 0).rows, nullptr, thread, b_row);
      const int k_tiles = t.k_tiles<kTileK>();
      for (int kt = 0; kt < k_tiles; ++kt) {
        pipeline.producer_acquire(write);
        const int stage = write.index();
        load_pieces<PiecesA, kAColMajor>(sA, stage, a, lda, a_tile_spans(kAColMajor, t, kt * kTileK), a_indices, a_row,
                                         thread);
        load_pieces<PiecesB, kBRowMajor>(sB, stage, b, ldb, b_tile_spans(kBRowMajor, t, kt * kTileK), b_indices, b_row,
                                         thread);
        pipeline.producer_commit(write, cutlass::arch::cpasync_barrier_arrive);
        ++write;
      }
    }
    pipeline.producer_tail(write);  // every stage consumed before the block's loads end
  }

  // The consumer warp groups: each tile's MMA, then its epilogue straight from registers.
  CUTLASS_DEVICE static void compute(const Params& p, Pipeline& pipeline, SharedStorage& shared, int mma_thread) {
    using namespace cute;
    Mainloop mainloop;
    TiledMma tiled_mma;
    PipelineState read;
    GroupTileWalker<kTileM, kTileN> walker(p.problems, p.num_groups);
    GatheredTile t;
    for (int64_t tile = blockIdx.x; walker.find(tile, t); tile += gridDim.x) {
      Tensor accumulators = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
      const int k_tiles = t.k_tiles<kTileK>();
      if (k_tiles > 0) {
        mainloop.mma(pipeline, read, accumulators, k_tiles, mma_thread, shared.tensors, {});
        mainloop.mma_tail(pipeline, read, k_tiles);
        read.advance(k_tiles);
      } else {
        clear(accumulators);
      }
      const typename Epilogue::Params epilogue_params{
          {1.0f, p.beta},
          static_cast<const Out*>(p.ptr[2][t.group]), StrideCD{p.ld[2][t.group], _1{}, 0},
          static_cast<Out*>(p.ptr[3][t.group]), StrideCD{p.ld[3][t.group], _1{}, 0}};
      Epilogue epilogue(epilogue_params);
      epilogue(make_shape(t.m, t.n, t.k, 1), TileShape{}, make_coord(t.m0 / kTileM, t.n0 / kTileN, 0, 0),
               accumulators, tiled_mma, make_shape(t.m - t.m0, t.n - t.n0, t.k), mma_thread, nullptr);
    }
  }

  CUTLASS_DEVICE void operator()(const Params& p, char* shared_bytes) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    SharedStorage& shared = *reinterpret_cast<SharedStorage*>(shared_bytes);
    const int thread = int(threadIdx.x);
    const bool loads = cutlass::canonical_warp_group_idx() == 0;
    typename Pipeline::Params pipeline_params;
    pipeline_params.role = loads ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pipeline_params.producer_arv_count = kLoadThreads;
    pipeline_params.consumer_arv_count = kMmaThreads;
    Pipeline pipeline(shared.pipeline, pipeline_params);
    __syncthreads();  // the pipeline's barriers are initialised before either side uses them
    if (loads)
      load(p, pipeline, shared, thread);
    else
      compute(p, pipeline, shared, thread % kMmaThreads);
#else
    (void)p, (void)shared_bytes;
#endif
  }
};

// One persistent wave of the gathered sm90 kernel for one input type, output type, layout and
// gathered operand.
template <typename In, typename Out, GemmLayout L, Gather kGather>
Status run_gathered_sm90(const GatheredGemmLaunch& l) {
  using Kernel = GatheredGroupedGemmSm90<In, Out, L, kGather>;
  static KernelAttributesOnce attributes;
  if (attributes.needed(l.gemm.device.device)) {
    if (cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Kernel::kSharedBytes) != cudaSuccess)
      return Status::Internal(std::string("the gathered sm90 GEMM's shared memory: ") +
                              cudaGetErrorString(cudaGetLastError()));
    attributes.done(l.gemm.device.device);
  }
  typename Kernel::Params params{l.gemm.problems, l.gemm.num_groups, {}, {}, l.indices, l.gemm.beta()};
  for (int i = 0; i < 4; ++i) params.ptr[i] = l.gemm.ptr[i], params.ld[i] = l.gemm.ld[i];
  cutlass::device_kernel<Kernel><<<l.gemm.device.sm_count, Kernel::MaxThreadsPerBlock, Kernel::kSharedBytes,
                                   l.gemm.stream>>>(params);
  return last_launch("the gathered sm90 grouped GEMM");
}

template <DType InType>
Status gathered_gemm_sm90_for(const GatheredGemmLaunch& l) {
  using In = typename Sm90Element<InType>::type;
  const bool wide = l.gemm.out_dtype == DType::f32;
  const GemmLayout layout = l.gemm.layout;
  if (l.gather == Gather::a_rows && layout == GemmLayout::row_row)
    return wide ? run_gathered_sm90<In, float, GemmLayout::row_row, Gather::a_rows>(l)
                : run_gathered_sm90<In, In, GemmLayout::row_row, Gather::a_rows>(l);
  if (l.gather == Gather::a_rows && layout == GemmLayout::row_col)
    return wide ? run_gathered_sm90<In, float, GemmLayout::row_col, Gather::a_rows>(l)
                : run_gathered_sm90<In, In, GemmLayout::row_col, Gather::a_rows>(l);
  if (l.gather == Gather::a_k && layout == GemmLayout::col_row && !wide)
    return run_gathered_sm90<In, In, GemmLayout::col_row, Gather::a_k>(l);
  if (l.gather == Gather::b_k && layout == GemmLayout::col_row && !wide)
    return run_gathered_sm90<In, In, GemmLayout::col_row, Gather::b_k>(l);
  return Status::Internal("the gathered sm90 GEMM takes A's rows in a forward layout, or a weight gradient's "
                          "gathered contraction with the inputs' output type");
}

}  // namespace cuda
}  // namespace groupgemm
