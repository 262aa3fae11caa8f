// The gathered grouped GEMM on sm_90a: WGMMA from shared memory, fed by cp.async loads
// whose rows of A come from each group's index array, so token rows enter the GEMM
// where they are, never as a [T*k, H] copy. TMA cannot gather (a descriptor covers one
// strided box), hence cp.async, as in CUTLASS's Hopper gather/scatter example; the
// consumer half is CUTLASS 3.x's cp.async warp-specialized cooperative mainloop (one
// producer warp group loads, two consumer warp groups share each 128 x 128 output tile),
// the loads are written here: the collective's own take one strided tensor.
//
// Persistent over the groups' tiles with the problem sizes only on the device: block b
// takes tiles b, b + gridDim.x, ... and finds each one's group by counting the groups'
// tiles from where its previous tile was, as CUTLASS 2.x's device-only problem visitor
// does. A group with k = 0 writes beta * C and runs no mainloop (the collective needs a
// k tile). Deterministic: one block owns each output tile and its whole K loop.
//
// Only compiled for sm_90a (a unit of the sm90 object library in cmake/core.cmake).
#pragma once

#include <algorithm>
#include <atomic>
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

// A group's part of the persistent tile sequence: the tile's group, its first row and
// column, and the group's problem.
struct GatheredTile {
  int group, m0, n0, m, n, k;
};

// Finds the group of each of a block's tiles. Tiles only grow along a block's sequence,
// so the walk resumes where the previous tile was found: O(G + tiles) per block.
template <int kTileM, int kTileN>
class GroupTileWalker {
 public:
  CUTLASS_DEVICE GroupTileWalker(const int32_t* problems, int num_groups)
      : problems_(problems), num_groups_(num_groups) {}

  CUTLASS_DEVICE bool find(int64_t tile, GatheredTile& out) {
    for (; group_ < num_groups_; ++group_) {
      const int m = problems_[3 * group_], n = problems_[3 * group_ + 1], k = problems_[3 * group_ + 2];
      const int64_t tiles_n = (n + kTileN - 1) / kTileN;
      const int64_t count = (m + kTileM - 1) / kTileM * tiles_n;
      if (tile < first_ + count) {
        const int64_t local = tile - first_;
        out = {group_, int(local / tiles_n) * kTileM, int(local % tiles_n) * kTileN, m, n, k};
        return true;
      }
      first_ += count;
    }
    return false;
  }

 private:
  const int32_t* problems_;
  int num_groups_;
  int group_ = 0;
  int64_t first_ = 0;  // the first tile of group_
};

template <typename In, typename Out, GemmLayout L>
struct GatheredGroupedGemmSm90 {
  static_assert(L == GemmLayout::row_row || L == GemmLayout::row_col, "A's rows are gathered in a forward layout");
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  static constexpr int kTileM = 128, kTileN = 128, kTileK = 64;
  static constexpr int kVector = 16 / int(sizeof(In));  // elements per 16-byte copy
  static constexpr bool kBRowMajor = L == GemmLayout::row_row;  // B [K, N]: N contiguous; else [N, K]

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

  // A tile row's 16-byte pieces spread over the load warp group: each thread copies the
  // same piece of kPasses rows, kRowsPerPass apart.
  template <int kContiguous, int kRows>
  struct Pieces {
    static constexpr int kPerRow = kContiguous / kVector;
    static constexpr int kRowsPerPass = kLoadThreads / kPerRow;
    static constexpr int kPasses = kRows / kRowsPerPass;
    static_assert(kLoadThreads % kPerRow == 0 && kRows % kRowsPerPass == 0, "the tile does not split into passes");
  };
  using PiecesA = Pieces<kTileK, kTileM>;                                     // A [m, k]: k contiguous
  using PiecesB = Pieces<kBRowMajor ? kTileN : kTileK, kBRowMajor ? kTileK : kTileN>;

  struct Params {
    const int32_t* problems;
    int num_groups;
    void* const* ptr[4];             // A, B, C, D per group
    const int64_t* ld[4];            // their leading dimensions
    const int32_t* const* indices;   // A's rows per group
    float beta;
  };

  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
  };
  static constexpr int kSharedBytes = int(sizeof(SharedStorage));
  static_assert(kSharedBytes <= int(kSm90SharedMemoryPerBlock), "the gathered sm90 kernel needs too much shared memory");

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
      const int32_t* rows = p.indices[t.group];
      // This thread's rows of A for the whole tile: read the index array once, not per k tile.
      const int a_piece = thread % PiecesA::kPerRow * kVector;
      const In* a_row[PiecesA::kPasses];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < PiecesA::kPasses; ++i) {
        const int r = t.m0 + thread / PiecesA::kPerRow + i * PiecesA::kRowsPerPass;
        a_row[i] = r < t.m ? a + int64_t(rows[r]) * lda : nullptr;
      }
      const int k_tiles = (t.k + kTileK - 1) / kTileK;
      for (int kt = 0; kt < k_tiles; ++kt) {
        pipeline.producer_acquire(write);
        const int stage = write.index();
        const int k0 = kt * kTileK;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < PiecesA::kPasses; ++i) {
          const int r = thread / PiecesA::kPerRow + i * PiecesA::kRowsPerPass;
          const int bytes = a_row[i] ? edge_bytes(t.k - (k0 + a_piece)) : 0;
          copy_16_bytes(&sA(r, a_piece, stage), bytes ? a_row[i] + k0 + a_piece : a, bytes);
        }
        const int b_piece = thread % PiecesB::kPerRow * kVector;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < PiecesB::kPasses; ++i) {
          const int r = thread / PiecesB::kPerRow + i * PiecesB::kRowsPerPass;
          if constexpr (kBRowMajor) {  // row r of the tile is k0 + r, the piece runs along n
            const int bytes = k0 + r < t.k ? edge_bytes(t.n - (t.n0 + b_piece)) : 0;
            copy_16_bytes(&sB(b_piece, r, stage), bytes ? b + int64_t(k0 + r) * ldb + t.n0 + b_piece : b, bytes);
          } else {  // row r is column t.n0 + r of the product, the piece runs along k
            const int bytes = t.n0 + r < t.n ? edge_bytes(t.k - (k0 + b_piece)) : 0;
            copy_16_bytes(&sB(r, b_piece, stage), bytes ? b + int64_t(t.n0 + r) * ldb + k0 + b_piece : b, bytes);
          }
        }
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
      const int k_tiles = (t.k + kTileK - 1) / kTileK;
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

  // Bytes of a 16-byte piece that lie inside the problem, `left` elements from its start.
  CUTLASS_DEVICE static int edge_bytes(int left) { return left >= kVector ? 16 : left > 0 ? left * int(sizeof(In)) : 0; }

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

// One persistent wave of the gathered sm90 kernel for one input type, output type and layout.
template <typename In, typename Out, GemmLayout L>
Status run_gathered_sm90(const GatheredGemmLaunch& l) {
  using Kernel = GatheredGroupedGemmSm90<In, Out, L>;
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
  if (l.gather != Gather::a_rows) return Status::Internal("the gathered sm90 GEMM gathers A's rows only");
  if (l.gemm.layout == GemmLayout::row_row)
    return wide ? run_gathered_sm90<In, float, GemmLayout::row_row>(l) : run_gathered_sm90<In, In, GemmLayout::row_row>(l);
  if (l.gemm.layout == GemmLayout::row_col)
    return wide ? run_gathered_sm90<In, float, GemmLayout::row_col>(l) : run_gathered_sm90<In, In, GemmLayout::row_col>(l);
  return Status::Internal("the gathered sm90 GEMM takes a forward layout");
}

}  // namespace cuda
}  // namespace groupgemm
