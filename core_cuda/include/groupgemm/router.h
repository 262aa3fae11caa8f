// The MoE router's softmax top-k and its backward, one token (one row of logits) at a
// time. __host__ __device__: the CPU backend and the CUDA kernel (one thread per token)
// run these same loops, in the same order, so each backend's bits are fixed by its
// inputs alone and the two frameworks, which call the same backend, agree bitwise.
//
// For a row l[0..E) and k:
//  - a NaN logit counts as -inf: a masked expert, never chosen and without weight in
//    either softmax (so one NaN does not turn a token's probabilities into NaN);
//  - the choices are the k largest logits, the larger first and, between equal logits,
//    the lower expert first; a masked expert is never chosen, and a slot left without a
//    choice is dropped: index -1, probability 0;
//  - renormalize: probs[j] = exp(l[i_j] - m) / sum over chosen c of exp(l[c] - m), the
//    softmax over the chosen logits (Mixtral); otherwise probs[j] = exp(l[i_j] - m) /
//    sum over every e of exp(l[e] - m), the full softmax's value (m = l[i_0], the max).
// Sums run in index order in float (double for float64 logits).
#pragma once

#include <stdint.h>

#include "groupgemm/activation.h"  // exp_of

namespace groupgemm {

// The logit the rules see: NaN counts as -inf.
template <typename A>
GG_HD A router_logit(A x) {
  return x == x ? x : -A(INFINITY);
}

// Whether a logit (as router_logit gives it) may be chosen: not -inf.
template <typename A>
GG_HD bool choosable(A x) {
  return x > -A(INFINITY);
}

// The logit accessor the rules use: logit(e) through router_logit.
template <typename Logit>
struct RouterLogits {
  const Logit& logit;
  GG_HD auto operator()(int64_t e) const { return router_logit(logit(e)); }
};
template <typename Logit>
GG_HD RouterLogits<Logit> router_logits(const Logit& logit) {
  return {logit};
}

// Whether slot index i names an expert. The backward and the tangent take the indices from
// their caller: one outside [0, E) counts as a dropped slot, as permute takes it, so no
// index reads past a row of logits.
GG_HD bool is_choice(int32_t i, int64_t experts) { return i >= 0 && i < experts; }

// The order of choices: x at expert e comes before y at expert f.
template <typename A>
GG_HD bool chosen_before(A x, int64_t e, A y, int64_t f) {
  return x > y || (x == y && e < f);
}

// Writes indices[0..k): the choices, then -1 for dropped slots. `logit(e)` is l[e]
// widened to A. Each pass takes the first logit in the order after the previous choice,
// so there is no scratch and no state beyond the previous choice.
template <typename A, typename Logit>
GG_HD void choose_experts(const Logit& logit, int64_t experts, int64_t k, int32_t* indices) {
  int64_t previous = -1;
  A previous_value = A(0);
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    A best_value = A(0);
    for (int64_t e = 0; e < experts; ++e) {
      const A x = logit(e);
      if (!choosable(x) || (previous >= 0 && !chosen_before(previous_value, previous, x, e))) continue;
      if (best < 0 || chosen_before(x, e, best_value, best)) best = e, best_value = x;
    }
    indices[j] = static_cast<int32_t>(best);
    if (best >= 0) previous = best, previous_value = best_value;
  }
}

// The normaliser of a row whose choices are `indices`: the sum of exp(l - m) over the
// chosen experts (renormalize) or over every expert.
template <typename A, typename Logit>
GG_HD A softmax_denominator(const Logit& logit, int64_t experts, int64_t k, const int32_t* indices,
                            bool renormalize, A max) {
  A sum = A(0);
  if (renormalize) {
    for (int64_t j = 0; j < k; ++j)
      if (is_choice(indices[j], experts)) sum += exp_of(logit(indices[j]) - max);
  } else {
    for (int64_t e = 0; e < experts; ++e) sum += exp_of(logit(e) - max);
  }
  return sum;
}

// One token's forward: indices[0..k) and probs[0..k).
template <typename A, typename RawLogit>
GG_HD void softmax_topk_row(const RawLogit& raw_logit, int64_t experts, int64_t k, bool renormalize,
                            int32_t* indices, A* probs) {
  const auto logit = router_logits(raw_logit);
  choose_experts<A>(logit, experts, k, indices);
  if (k == 0 || indices[0] < 0) {
    for (int64_t j = 0; j < k; ++j) probs[j] = A(0);
    return;
  }
  const A max = logit(indices[0]);
  const A sum = softmax_denominator(logit, experts, k, indices, renormalize, max);
  for (int64_t j = 0; j < k; ++j)
    probs[j] = is_choice(indices[j], experts) ? exp_of(logit(indices[j]) - max) / sum : A(0);
}

// One token's backward: dlogits[e] for every e, through `write(e, value)`, from the
// forward's indices and the incoming dprobs (dropped slots' ignored). With w the probs
// and s = sum over valid j of dprobs[j] * w[j]:
//  - renormalize: dl[i_j] = w[j] * (dprobs[j] - s), every other expert 0;
//  - otherwise:   dl[e] = p[e] * (g[e] - s), p the full softmax, g[e] = dprobs[j] when
//    e = i_j, else 0.
template <typename A, typename RawLogit, typename DProb, typename Write>
GG_HD void softmax_topk_backward_row(const RawLogit& raw_logit, int64_t experts, int64_t k, bool renormalize,
                                     const int32_t* indices, const DProb& dprob, const Write& write) {
  if (k == 0 || !is_choice(indices[0], experts)) {
    for (int64_t e = 0; e < experts; ++e) write(e, A(0));
    return;
  }
  const auto logit = router_logits(raw_logit);
  const A max = logit(indices[0]);
  const A sum = softmax_denominator(logit, experts, k, indices, renormalize, max);
  A s = A(0);
  for (int64_t j = 0; j < k; ++j)
    if (is_choice(indices[j], experts)) s += dprob(j) * (exp_of(logit(indices[j]) - max) / sum);
  for (int64_t e = 0; e < experts; ++e) {
    int64_t slot = -1;
    for (int64_t j = 0; j < k; ++j)
      if (indices[j] == e) slot = j;
    if ((renormalize && slot < 0) || !choosable(logit(e))) {  // outside the softmax: exactly 0
      write(e, A(0));
      continue;
    }
    const A p = exp_of(logit(e) - max) / sum;
    write(e, p * ((slot < 0 ? A(0) : dprob(slot)) - s));
  }
}

// One token's forward-mode derivative: tprobs[j] = the tangent of probs[j] for the
// logits' tangent tlogit(e), the choices held fixed (dropped slots 0). With w the probs
// and t[j] = tlogit(i_j):
//  - renormalize: tprobs[j] = w[j] * (t[j] - sum over valid l of w[l] * t[l]);
//  - otherwise:   tprobs[j] = w[j] * (t[j] - sum over unmasked e of p[e] * tlogit(e)), p
//    the full softmax (a masked expert's tangent has no effect, as its column of J is 0).
template <typename A, typename RawLogit, typename TLogit>
GG_HD void softmax_topk_tangent_row(const RawLogit& raw_logit, int64_t experts, int64_t k, bool renormalize,
                                    const int32_t* indices, const TLogit& tlogit, A* tprobs) {
  if (k == 0 || !is_choice(indices[0], experts)) {
    for (int64_t j = 0; j < k; ++j) tprobs[j] = A(0);
    return;
  }
  const auto logit = router_logits(raw_logit);
  const A max = logit(indices[0]);
  const A sum = softmax_denominator(logit, experts, k, indices, renormalize, max);
  A mean = A(0);
  if (renormalize) {
    for (int64_t j = 0; j < k; ++j)
      if (is_choice(indices[j], experts)) mean += tlogit(indices[j]) * (exp_of(logit(indices[j]) - max) / sum);
  } else {
    for (int64_t e = 0; e < experts; ++e)
      if (choosable(logit(e))) mean += tlogit(e) * (exp_of(logit(e) - max) / sum);
  }
  for (int64_t j = 0; j < k; ++j)
    tprobs[j] = is_choice(indices[j], experts) ? (exp_of(logit(indices[j]) - max) / sum) * (tlogit(indices[j]) - mean)
                                               : A(0);
}

}  // namespace groupgemm
