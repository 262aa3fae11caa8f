// The index arithmetic of the expert layer's token ops, as __host__ __device__ steps that
// the CPU backend and the CUDA kernels both run, so the CPU tests cover the GPU's logic.
//
// permute is a stable counting sort of the T*k slots (slot s = t*k + j sends token t to
// expert expert_indices[t, j]) into E + 1 buckets: one per expert, then bucket E for the
// dropped slots (an index outside [0, E)). It runs over C chunks of contiguous slots:
//   1. count:  chunk c counts its slots per bucket into counts[b * C + c];
//   2. scan:   an exclusive scan of counts in that (bucket-major, chunk-minor) order makes
//              each entry the first row of chunk c's slots in bucket b. It runs in two
//              parts that the GPU spreads over blocks: each bucket's C entries are scanned
//              on their own (its total set aside), then the E + 1 totals are scanned into
//              each bucket's first row, bucket_start[b]; the entry for (b, c) is then
//              bucket_start[b] + counts[b * C + c]. Group sizes and the number of kept
//              rows are read off bucket_start;
//   3. assign: each chunk walks its slots in order, giving each the next row of its bucket;
//   4. fill:   each kept slot's token row is copied to its row; rows of dropped slots are 0.
// Any C gives the same rows: the CPU runs C = 1, the CUDA backend one chunk per thread
// (permute_chunks), the core tests 1, 3 and 256.
//
// unpermute and its backward read row_map entries they did not write: an entry outside
// [0, R) is a dropped slot and touches nothing.
#pragma once

#include <cstdint>

#include "groupgemm/schedule.h"

namespace groupgemm {

// ---- permute ------------------------------------------------------------------------

// Bucket of a slot: its expert, or num_experts for a dropped slot (any index value).
GG_HD int64_t slot_bucket(const IndexArray& expert_indices, int64_t slot, int64_t num_experts) {
  const int64_t e = load_index(expert_indices.data, expert_indices.type, slot);
  return e >= 0 && e < num_experts ? e : num_experts;
}

// The counts array: one int32 per (bucket, chunk), bucket-major.
GG_HD int64_t count_index(int64_t bucket, int64_t chunk, int64_t chunks) { return bucket * chunks + chunk; }
GG_HD int64_t count_entries(int64_t num_experts, int64_t chunks) { return (num_experts + 1) * chunks; }

// Chunk c of `chunks` contiguous slot ranges (trailing chunks may be empty).
GG_HD RowRange slot_chunk(int64_t c, int64_t chunks, int64_t num_slots) {
  const int64_t size = ceil_div(num_slots, chunks);
  const int64_t begin = c * size < num_slots ? c * size : num_slots;
  return {begin, size < num_slots - begin ? begin + size : num_slots};
}

// The CUDA backend's chunk count: about 16 slots per thread (each thread walks its chunk
// twice), with the counts array held to 2^22 entries (16 MiB). A function of the sizes
// only, so the workspace size is too.
constexpr int64_t kPermuteSlotsPerChunk = 16;
constexpr int64_t kPermuteMaxCountEntries = int64_t(1) << 22;

GG_HD int64_t permute_chunks(int64_t num_slots, int64_t num_experts) {
  int64_t chunks = ceil_div(num_slots, kPermuteSlotsPerChunk);
  const int64_t budget = kPermuteMaxCountEntries / (num_experts + 1);
  if (chunks > budget) chunks = budget;
  return chunks < 1 ? 1 : chunks;
}

// Step 1: chunk c's column of counts.
GG_HD void count_chunk_slots(const IndexArray& expert_indices, int64_t num_slots, int64_t num_experts,
                             int64_t c, int64_t chunks, int32_t* counts) {
  for (int64_t b = 0; b <= num_experts; ++b) counts[count_index(b, c, chunks)] = 0;
  const RowRange slots = slot_chunk(c, chunks, num_slots);
  for (int64_t s = slots.begin; s < slots.end; ++s)
    ++counts[count_index(slot_bucket(expert_indices, s, num_experts), c, chunks)];
}

// Exclusive scan of n int32 in place, in order; returns the total. Step 2's two parts on
// the host (the GPU runs block scans of the same entries).
GG_HD int32_t exclusive_scan_in_place(int32_t* values, int64_t n) {
  int32_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t v = values[i];
    values[i] = total;
    total += v;
  }
  return total;
}

// Step 2a: bucket b's entries, contiguous in the bucket-major counts array.
GG_HD int32_t* bucket_counts(int32_t* counts, int64_t bucket, int64_t chunks) {
  return counts + count_index(bucket, 0, chunks);
}

// Step 2b's results, read from bucket_start (E + 1 entries).
GG_HD int32_t group_size_from_starts(const int32_t* bucket_start, int64_t expert) {
  return bucket_start[expert + 1] - bucket_start[expert];
}
GG_HD int32_t kept_rows_from_starts(const int32_t* bucket_start, int64_t num_experts) {
  return bucket_start[num_experts];  // where the dropped bucket starts
}

// row_map's entry for a slot given its row: the row, or -1 when the slot is dropped.
GG_HD int32_t row_map_value(int64_t bucket, int32_t row, int64_t num_experts) {
  return bucket < num_experts ? row : -1;
}

// Step 3: chunk c walks its slots in order; its offsets within each bucket (`cursors`,
// the scanned counts) advance as rows are handed out, so slots of one bucket get
// consecutive rows in slot order.
GG_HD void assign_chunk_rows(const IndexArray& expert_indices, int64_t num_slots, int64_t num_experts,
                             int64_t c, int64_t chunks, const int32_t* bucket_start, int32_t* cursors,
                             int32_t* row_map) {
  const RowRange slots = slot_chunk(c, chunks, num_slots);
  for (int64_t s = slots.begin; s < slots.end; ++s) {
    const int64_t bucket = slot_bucket(expert_indices, s, num_experts);
    const int32_t row = bucket_start[bucket] + cursors[count_index(bucket, c, chunks)]++;
    row_map[s] = row_map_value(bucket, row, num_experts);
  }
}

// Step 4 for item i in [0, T*k), which is both a slot and a row: slot i's token row goes
// to row copy_row (when the slot is kept), and row i is zeroed when it lies past the kept
// rows (a dropped slot's). Every row is written exactly once over all items.
struct PermuteFill {
  int64_t copy_row;  // row_map[i], or -1: nothing to copy
  int64_t token;     // i / k, the token row copied there
  bool zero_row;     // row i holds a dropped slot
};

GG_HD PermuteFill permute_fill(const int32_t* row_map, int64_t i, int64_t top_k, int64_t kept_rows) {
  const int64_t row = row_map[i];
  return {row, i / top_k, i >= kept_rows};
}

// Steps 1-3 in sequence on the host with `chunks` chunks: writes row_map and group_sizes
// and returns the number of kept rows. `counts` holds count_entries(E, chunks) entries,
// `bucket_start` E + 1.
inline int64_t permute_rows_on_host(const PermuteArgs& a, int64_t chunks, int32_t* counts,
                                    int32_t* bucket_start) {
  const int64_t slots = a.num_tokens * a.top_k, buckets = a.num_experts + 1;
  for (int64_t c = 0; c < chunks; ++c)
    count_chunk_slots(a.expert_indices, slots, a.num_experts, c, chunks, counts);
  for (int64_t b = 0; b < buckets; ++b)
    bucket_start[b] = exclusive_scan_in_place(bucket_counts(counts, b, chunks), chunks);
  exclusive_scan_in_place(bucket_start, buckets);
  for (int64_t e = 0; e < a.num_experts; ++e) a.group_sizes[e] = group_size_from_starts(bucket_start, e);
  for (int64_t c = 0; c < chunks; ++c)
    assign_chunk_rows(a.expert_indices, slots, a.num_experts, c, chunks, bucket_start, counts, a.row_map);
  return kept_rows_from_starts(bucket_start, a.num_experts);
}

// ---- unpermute and its backward -----------------------------------------------------

// Whether a row_map entry names a row of permuted [R, H].
GG_HD bool maps_to_row(int64_t row, int64_t num_rows) { return row >= 0 && row < num_rows; }

// acc + a * b with the product rounded before the sum: never a fused multiply-add, so the
// host and the device round alike.
GG_HD float add_product(float acc, float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(acc, __fmul_rn(a, b));
#else
  return acc + a * b;
#endif
}
GG_HD double add_product(double acc, double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(acc, __dmul_rn(a, b));
#else
  return acc + a * b;
#endif
}

// out[t, h]: the sum over j in order of prob(j) * value(row_map_t[j]), where value(r)
// reads permuted[r, h] and prob(j) probs[t, j] (or 1), both widened to Acc.
template <typename Acc, typename Value, typename Prob>
GG_HD Acc unpermute_sum(const int32_t* row_map_t, int64_t top_k, int64_t num_rows, Value value, Prob prob) {
  Acc acc = 0;
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t row = row_map_t[j];
    if (maps_to_row(row, num_rows)) acc = add_product(acc, prob(j), value(row));
  }
  return acc;
}

// dprobs[t, j] = dot(permuted[row], dout[t]) in one fixed order on both backends: lane l
// of 32 sums the terms h = l, l + 32, ... in order (a warp's lanes on the GPU), then the
// lanes fold pairwise, halving: lane l += lane l + 16, then + 8, + 4, + 2, + 1.
constexpr int kDotLanes = 32;

template <typename Acc, typename X, typename Y>
GG_HD Acc dot_lane_partial(int64_t lane, int64_t n, X x, Y y) {
  Acc acc = 0;
  for (int64_t h = lane; h < n; h += kDotLanes) acc = add_product(acc, x(h), y(h));
  return acc;
}

// The fold on the host (the GPU runs it with warp shuffles); `partial` has kDotLanes entries.
template <typename Acc>
inline Acc fold_dot_lanes(Acc* partial) {
  for (int offset = kDotLanes / 2; offset > 0; offset /= 2)
    for (int l = 0; l < offset; ++l) partial[l] = partial[l] + partial[l + offset];
  return partial[0];
}

}  // namespace groupgemm
