// permute on the device: groupgemm/permute.h's steps, one kernel each, reading the
// expert indices where they live: the counting sort of counting_sort.cuh (permute_chunks
// chunks), then the fill, which copies rows as raw bits. No atomics, no host
// synchronisation.
#include "counting_sort.cuh"
#include "expert_kernels.h"
#include "permute_workspace.h"

namespace groupgemm {
namespace cuda {
namespace {

struct PermuteWorkspace {
  int32_t* kept_rows;
  int32_t* bucket_start;
  int32_t* counts;
};

PermuteWorkspace permute_workspace(void* base, const PermuteWorkspaceLayout& l) {
  char* b = static_cast<char*>(base);
  return {reinterpret_cast<int32_t*>(b + l.kept_rows), reinterpret_cast<int32_t*>(b + l.bucket_start),
          reinterpret_cast<int32_t*>(b + l.counts)};
}

// Word: an unsigned integer of the element's size, so a copy keeps every bit.
template <typename Word>
__global__ void fill_kernel(const Word* tokens, Word* permuted, const int32_t* row_map,
                            const int32_t* kept_rows, int64_t slots, int64_t top_k, int64_t hidden) {
  const int64_t kept = *kept_rows;
  for (int64_t i = blockIdx.x; i < slots; i += gridDim.x) {
    const PermuteFill fill = permute_fill(row_map, i, top_k, kept);
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) {
      if (fill.copy_row >= 0) permuted[fill.copy_row * hidden + j] = tokens[fill.token * hidden + j];
      if (fill.zero_row) permuted[i * hidden + j] = Word(0);
    }
  }
}

template <typename Word>
Status launch_fill(const PermuteArgs& a, const int32_t* kept_rows, cudaStream_t stream) {
  const int64_t slots = a.num_tokens * a.top_k;
  fill_kernel<Word><<<grid_dim(slots, 65536), kThreads, 0, stream>>>(
      static_cast<const Word*>(a.tokens), static_cast<Word*>(a.permuted), a.row_map, kept_rows, slots,
      a.top_k, a.hidden);
  return last_launch("the permute fill kernel");
}

}  // namespace

Status launch_permute(const PermuteArgs& a, void* workspace, cudaStream_t stream) {
  const int64_t slots = a.num_tokens * a.top_k;
  const PermuteWorkspaceLayout layout = permute_workspace_layout(slots, a.num_experts);
  const PermuteWorkspace ws = permute_workspace(workspace, layout);
  GG_RETURN_IF_ERROR(launch_counting_sort(
      ExpertBucket{a.expert_indices, a.num_experts}, slots, a.num_experts + 1, layout.chunks, ws.counts,
      ws.bucket_start, RowMapEntry{a.row_map, a.num_experts}, a.group_sizes, ws.kept_rows, stream));
  if (slots == 0) return Status::Ok();  // group_sizes (all 0) was the only output
  if (a.hidden == 0) return Status::Ok();
  switch (dtype_size(a.dtype)) {
    case 2: return launch_fill<uint16_t>(a, ws.kept_rows, stream);
    case 4: return launch_fill<uint32_t>(a, ws.kept_rows, stream);
    default: return launch_fill<uint64_t>(a, ws.kept_rows, stream);
  }
}

}  // namespace cuda
}  // namespace groupgemm
