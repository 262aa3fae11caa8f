// The fused expert MLP's routing arithmetic, as __host__ __device__ steps that the CPU
// backend and the CUDA kernels both run, so the CPU tests cover the GPU's index logic.
//
// expert_mlp (types.h, ExpertMlpArgs) is permute, the grouped MLP and unpermute in one call,
// without the [T*k, H] copy of the tokens: each expert's rows exist only as indices, and a
// block of them is read from `tokens` through the routing when it is multiplied.
//
// The routing is permute's stable counting sort (permute.h) over the local window: slot
// s = t*k + j goes to local expert e = expert_indices[t, j] - group_offset when the id is not
// negative and e lies in [0, E), else to bucket E (dropped: it adds nothing). It gives
//   - row_map[s]: the slot's row, experts ascending and slots ascending within one (the
//     rows permute would give it with that window), or -1 for a dropped slot;
//   - slot_of_row[r]: the slot whose row is r, for the kept rows;
//   - bucket_start[e]: expert e's first row; its rows are [bucket_start[e], bucket_start[e + 1]).
// Expert outputs and the backward's token-row gradients are scratch rows in that order
// (rows of a block are contiguous there), summed per token in slot order j = 0..k-1 as
// unpermute does (permute.h's unpermute_sum), so the sums are the composition's.
//
// The pre-activation h that the backward keeps is in slot order instead, [T, k, F_in] with
// h[s] the fc1 output of slot s (exact zeros for a dropped slot): a token's rows stay with
// the token, so h does not depend on how tokens are split over devices or batched.
#pragma once

#include <cstdint>

#include "groupgemm/permute.h"

namespace groupgemm {

// The local expert of global id `id` for the window [group_offset, group_offset + E), or E
// when the slot is dropped (a negative id, or one outside the window). The difference is
// taken in uint64 after the comparison, so no id or offset overflows it.
GG_HD int64_t window_bucket(int64_t id, int64_t group_offset, int64_t num_local) {
  if (id < 0 || id < group_offset) return num_local;
  const uint64_t local = static_cast<uint64_t>(id) - static_cast<uint64_t>(group_offset);
  return local < static_cast<uint64_t>(num_local) ? static_cast<int64_t>(local) : num_local;
}

// The routing's buckets, as the counting sort takes them: group_offset read where it lives
// (device memory on CUDA), absent meaning 0.
struct WindowBucket {
  IndexArray expert_indices;
  IndexArray group_offset;
  int64_t num_local;
  GG_HD int64_t operator()(int64_t slot) const {
    return window_bucket(load_index(expert_indices.data, expert_indices.type, slot),
                         read_group_offset(group_offset), num_local);
  }
};

// Step 3's record: each slot's row_map entry, and each kept row's slot; with token_of_row,
// also each kept row's token (the CUDA backend's GEMMs read token rows through it).
struct RoutedSlot {
  int32_t* row_map;
  int32_t* slot_of_row;
  int64_t num_local;
  int32_t* token_of_row = nullptr;
  int64_t top_k = 1;
  GG_HD void operator()(int64_t slot, int64_t bucket, int32_t row) const {
    row_map[slot] = row_map_value(bucket, row, num_local);
    if (bucket >= num_local) return;
    slot_of_row[row] = static_cast<int32_t>(slot);
    if (token_of_row) token_of_row[row] = static_cast<int32_t>(slot / top_k);
  }
};

// The token whose row is r.
GG_HD int64_t token_of_row(const int32_t* slot_of_row, int64_t row, int64_t top_k) {
  return slot_of_row[row] / top_k;
}

// Rows [begin, end) of local expert e, from the routing's bucket starts.
GG_HD RowRange expert_rows(const int32_t* bucket_start, int64_t expert) {
  return {bucket_start[expert], bucket_start[expert + 1]};
}

// The local expert whose rows hold kept row `row` (row < bucket_start[E]): the last expert
// whose rows start at or before it (experts without rows share their start with the next).
GG_HD int64_t expert_of_row(const int32_t* bucket_start, int64_t num_local, int64_t row) {
  int64_t lo = 0, hi = num_local;  // bucket_start[lo] <= row < bucket_start[hi]
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (bucket_start[mid] <= row)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// The blocks an expert's rows are multiplied in: as few as hold at most `max_rows` rows
// each, as even as can be in whole steps of `step` rows (the first ones a step longer),
// the rows past the last whole step added to the last block. So no block is much shorter
// than the others (a library GEMM may round the rows of a very short call differently
// from the same rows inside a longer one), and every block but the last is a whole number
// of steps. max_rows is a whole number of steps, and at least `count` steps are there to
// share (else step is 1).
GG_HD int64_t block_count(RowRange rows, int64_t max_rows) { return ceil_div(rows.rows(), max_rows); }
GG_HD RowRange block_of(RowRange rows, int64_t block, int64_t count, int64_t step = 1) {
  const int64_t steps = rows.rows() / step, base = steps / count, longer = steps % count;
  const int64_t begin = rows.begin + (block * base + (block < longer ? block : longer)) * step;
  const int64_t end = begin + (base + (block < longer ? 1 : 0)) * step;
  return {begin, block == count - 1 ? rows.end : end};
}

// The routing on the host with `chunks` chunks (permute.h's steps 1-3); returns the kept
// rows. `counts` holds count_entries(E, chunks) entries, `bucket_start` E + 1, `row_map`
// T * k and `slot_of_row` T * k.
inline int64_t expert_routing_on_host(const IndexArray& expert_indices, int64_t num_slots,
                                      const IndexArray& group_offset, int64_t num_local, int64_t chunks,
                                      int32_t* counts, int32_t* bucket_start, int32_t* row_map,
                                      int32_t* slot_of_row) {
  counting_sort_on_host(WindowBucket{expert_indices, group_offset, num_local}, num_slots, num_local + 1,
                        chunks, counts, bucket_start, RoutedSlot{row_map, slot_of_row, num_local});
  return kept_rows_from_starts(bucket_start, num_local);
}

// The routing weight's gradient of a kept slot needs no saved expert output: with
// g[row] = dout[t] @ w_out[e]^T (the unweighted input gradient of fc2's output),
//   dprobs[t, j] = dot(dout[t], y[row]) = dot(act[row], g[row]) + dot(b_out[e], dout[t]),
// each dot in permute.h's fixed lane order (dot_lane_partial, then the pairwise fold), the
// bias's added last; and fc2's input gradient is probs[t, j] * g[row], rounded once.

}  // namespace groupgemm
