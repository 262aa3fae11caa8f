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
//   3. place:  each chunk walks its slots in order, giving each the next row of its bucket;
//   4. fill:   each kept slot's token row is copied to its row; rows of dropped slots are 0.
// Any C gives the same rows: the CPU runs C = 1, the CUDA backend one chunk per thread
// (permute_chunks), the core tests 1, 3 and 256.
//
// unpermute and its backward read row_map entries they did not write: an entry outside
// [0, R) is a dropped slot and touches nothing, and a row named by several slots gets the
// sum of their gradients in slot order (the row sort below).
#pragma once

#include <cstdint>

#include "groupgemm/schedule.h"

namespace groupgemm {

// ---- the stable counting sort ------------------------------------------------------
// Items 0..n-1, each in a bucket bucket(i) of [0, B), sorted by bucket and, within one, by
// item, over C chunks of contiguous items (steps 1-3 above, `place` receiving each item's
// position). permute sorts slots by expert; unpermute's backward sorts slots by row.

// The counts array: one int32 per (bucket, chunk), bucket-major.
GG_HD int64_t count_index(int64_t bucket, int64_t chunk, int64_t chunks) { return bucket * chunks + chunk; }

// Chunk c of `chunks` contiguous item ranges (trailing chunks may be empty).
GG_HD RowRange slot_chunk(int64_t c, int64_t chunks, int64_t num_items) {
  const int64_t size = ceil_div(num_items, chunks);
  const int64_t begin = c * size < num_items ? c * size : num_items;
  return {begin, size < num_items - begin ? begin + size : num_items};
}

// Step 1: chunk c's column of counts.
template <typename Bucket>
GG_HD void count_chunk(const Bucket& bucket, int64_t num_items, int64_t buckets, int64_t c, int64_t chunks,
                       int32_t* counts) {
  for (int64_t b = 0; b < buckets; ++b) counts[count_index(b, c, chunks)] = 0;
  const RowRange items = slot_chunk(c, chunks, num_items);
  for (int64_t i = items.begin; i < items.end; ++i) ++counts[count_index(bucket(i), c, chunks)];
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

// Step 3: chunk c walks its items in order; its offsets within each bucket (`cursors`,
// the scanned counts) advance as positions are handed out, so items of one bucket get
// consecutive positions in item order. place(i, bucket, position) records each.
template <typename Bucket, typename Place>
GG_HD void place_chunk(const Bucket& bucket, int64_t num_items, int64_t c, int64_t chunks,
                       const int32_t* bucket_start, int32_t* cursors, const Place& place) {
  const RowRange items = slot_chunk(c, chunks, num_items);
  for (int64_t i = items.begin; i < items.end; ++i) {
    const int64_t b = bucket(i);
    place(i, b, bucket_start[b] + cursors[count_index(b, c, chunks)]++);
  }
}

// Steps 1-3 on the host with `chunks` chunks. `counts` holds buckets * chunks entries,
// `bucket_start` `buckets` (each bucket's first position, when this returns).
template <typename Bucket, typename Place>
void counting_sort_on_host(const Bucket& bucket, int64_t num_items, int64_t buckets, int64_t chunks,
                           int32_t* counts, int32_t* bucket_start, const Place& place) {
  for (int64_t c = 0; c < chunks; ++c) count_chunk(bucket, num_items, buckets, c, chunks, counts);
  for (int64_t b = 0; b < buckets; ++b)
    bucket_start[b] = exclusive_scan_in_place(bucket_counts(counts, b, chunks), chunks);
  exclusive_scan_in_place(bucket_start, buckets);
  for (int64_t c = 0; c < chunks; ++c) place_chunk(bucket, num_items, c, chunks, bucket_start, counts, place);
}

// The CUDA backend's chunk count: about 16 items per thread (each thread walks its chunk
// twice), with the counts array held to 2^22 entries (16 MiB). A function of the sizes
// only, so the workspace size is too.
constexpr int64_t kPermuteSlotsPerChunk = 16;
constexpr int64_t kPermuteMaxCountEntries = int64_t(1) << 22;

GG_HD int64_t sort_chunks(int64_t num_items, int64_t buckets) {
  int64_t chunks = ceil_div(num_items, kPermuteSlotsPerChunk);
  const int64_t budget = kPermuteMaxCountEntries / buckets;
  if (chunks > budget) chunks = budget;
  return chunks < 1 ? 1 : chunks;
}

// ---- permute ------------------------------------------------------------------------

// Bucket of a slot: its expert, or num_experts for a dropped slot (any index value).
GG_HD int64_t slot_bucket(const IndexArray& expert_indices, int64_t slot, int64_t num_experts) {
  const int64_t e = load_index(expert_indices.data, expert_indices.type, slot);
  return e >= 0 && e < num_experts ? e : num_experts;
}

// permute's buckets, as the counting sort takes them.
struct ExpertBucket {
  IndexArray expert_indices;
  int64_t num_experts;
  GG_HD int64_t operator()(int64_t slot) const { return slot_bucket(expert_indices, slot, num_experts); }
};

// permute's counts array and the CUDA backend's chunk count for it.
GG_HD int64_t count_entries(int64_t num_experts, int64_t chunks) { return (num_experts + 1) * chunks; }
GG_HD int64_t permute_chunks(int64_t num_slots, int64_t num_experts) {
  return sort_chunks(num_slots, num_experts + 1);
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

// Step 3's record for permute: each slot's row_map entry.
struct RowMapEntry {
  int32_t* row_map;
  int64_t num_experts;
  GG_HD void operator()(int64_t slot, int64_t bucket, int32_t row) const {
    row_map[slot] = row_map_value(bucket, row, num_experts);
  }
};

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
  const int64_t slots = a.num_tokens * a.top_k;
  counting_sort_on_host(ExpertBucket{a.expert_indices, a.num_experts}, slots, a.num_experts + 1, chunks,
                        counts, bucket_start, RowMapEntry{a.row_map, a.num_experts});
  for (int64_t e = 0; e < a.num_experts; ++e) a.group_sizes[e] = group_size_from_starts(bucket_start, e);
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

// ---- unpermute's backward: each row's slots --------------------------------------------
// dpermuted[r] is the sum of probs[t, j] * dout[t] over the slots (t, j) whose row_map
// entry is r, in ascending slot order s = t*k + j: the forward adds every slot naming a
// row, so a row named twice (not a row_map permute makes, but one a caller may pass) gets
// both terms back. Each row's slots come from a stable sort of the slots by row key (the
// row, or one key past every row for an entry outside [0, R)): an LSD radix sort of 8-bit
// digits, each pass the counting sort above with 256 buckets, so the GPU runs it in many
// chunks with a counts array of 256 C entries whatever R is. Row r's slots are then the
// positions whose key is r, found by binary search; a row with none gets exact zeros.

constexpr int kRowDigitBits = 8;
constexpr int64_t kRowDigitBuckets = int64_t(1) << kRowDigitBits;

// The key every entry outside [0, R) shares: past every row a row_map entry (int32) can name.
GG_HD int64_t dropped_row_key(int64_t num_rows) {
  const int64_t past_int32 = int64_t(1) << 31;
  return num_rows < past_int32 ? num_rows : past_int32;
}

GG_HD int64_t row_key(int64_t row, int64_t num_rows) {
  return maps_to_row(row, num_rows) ? row : dropped_row_key(num_rows);
}

// Radix passes that cover every key (at least one).
GG_HD int row_sort_passes(int64_t num_rows) {
  int passes = 1;
  while (dropped_row_key(num_rows) >> (kRowDigitBits * passes)) ++passes;
  return passes;
}

// The slots in an order: order[i], or i itself before the first pass (order == nullptr).
GG_HD int64_t slot_at(const int32_t* order, int64_t i) { return order ? order[i] : i; }

// One pass's bucket of position i: the digit at `shift` of the key of the slot there.
struct RowDigit {
  const int32_t* row_map;
  const int32_t* order;
  int64_t num_rows;
  int shift;
  GG_HD int64_t operator()(int64_t i) const {
    return (row_key(row_map[slot_at(order, i)], num_rows) >> shift) & (kRowDigitBuckets - 1);
  }
};

// A pass's record: the slot at position i moves to `position`.
struct NextOrder {
  const int32_t* order;
  int32_t* next;
  GG_HD void operator()(int64_t i, int64_t, int32_t position) const {
    next[position] = static_cast<int32_t>(slot_at(order, i));
  }
};

// The CUDA backend's chunk count of each pass.
GG_HD int64_t row_sort_chunks(int64_t num_slots) { return sort_chunks(num_slots, kRowDigitBuckets); }

// The positions [begin, end) of row r's slots in `sorted` (the slots sorted by row key):
// a binary search for the first key >= r, then for the first key > r.
GG_HD int64_t first_key_at_least(const int32_t* row_map, const int32_t* sorted, int64_t num_slots,
                                 int64_t num_rows, int64_t key) {
  int64_t lo = 0, hi = num_slots;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (row_key(row_map[sorted[mid]], num_rows) < key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

GG_HD RowRange row_slots(const int32_t* row_map, const int32_t* sorted, int64_t num_slots, int64_t num_rows,
                         int64_t row) {
  return {first_key_at_least(row_map, sorted, num_slots, num_rows, row),
          first_key_at_least(row_map, sorted, num_slots, num_rows, row + 1)};
}

// The same range from where it begins, by walking to the first key past the row: a
// walk over consecutive rows (the CPU backend's) starts each row where the last ended.
GG_HD RowRange row_slots_from(const int32_t* row_map, const int32_t* sorted, int64_t num_slots,
                              int64_t num_rows, int64_t row, int64_t begin) {
  int64_t end = begin;
  while (end < num_slots && row_key(row_map[sorted[end]], num_rows) == row) ++end;
  return {begin, end};
}

// a * b rounded once (never fused into a later sum).
GG_HD float product(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
GG_HD double product(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// One term of a row's sum in Acc: the first term is the product itself (a row of one slot
// gets prob * dout rounded once, -0.0 kept), each later one is added to the sum so far.
template <typename Acc>
GG_HD Acc add_row_term(Acc sum, bool first, Acc prob, Acc dout) {
  return first ? product(prob, dout) : add_product(sum, prob, dout);
}

// dpermuted[r, h]: the sum over row r's slots s = sorted[slots.begin..end), in order, of
// prob(s) * dout(s / k), widened to Acc; exactly 0 for a row with no slot. (The CPU
// backend adds the same terms a whole row at a time.)
template <typename Acc, typename Dout, typename Prob>
GG_HD Acc row_gradient(const int32_t* sorted, RowRange slots, int64_t top_k, Dout dout, Prob prob) {
  Acc sum = Acc(0);
  for (int64_t i = slots.begin; i < slots.end; ++i) {
    const int64_t s = sorted[i];
    sum = add_row_term<Acc>(sum, i == slots.begin, prob(s), dout(s / top_k));
  }
  return sum;
}

// The radix passes on the host with `chunks` chunks per pass; returns the sorted slots
// (order_a or order_b). `counts` holds kRowDigitBuckets * chunks entries, `bucket_start`
// kRowDigitBuckets, order_a and order_b num_slots each.
inline const int32_t* sort_slots_by_row_on_host(const int32_t* row_map, int64_t num_slots, int64_t num_rows,
                                                int64_t chunks, int32_t* counts, int32_t* bucket_start,
                                                int32_t* order_a, int32_t* order_b) {
  const int32_t* order = nullptr;
  int32_t* next = order_a;
  for (int pass = 0; pass < row_sort_passes(num_rows); ++pass) {
    counting_sort_on_host(RowDigit{row_map, order, num_rows, kRowDigitBits * pass}, num_slots,
                          kRowDigitBuckets, chunks, counts, bucket_start, NextOrder{order, next});
    order = next;
    next = next == order_a ? order_b : order_a;
  }
  return order;
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
