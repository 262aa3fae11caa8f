// Which of a call's per-group GEMMs run alone on all threads and which side by side, one
// thread each. A GEMM split across the threads costs a synchronisation and leaves each
// thread a thin slice (an MoE layer's groups are small); side by side, each runs whole on
// one thread, largest first. That wins while the threads finish together, and loses when
// a few large groups (skewed routing) would leave a thread idle: those run alone first.
//
// Pure arithmetic on the GEMMs' sizes and the thread count, so the choice, like a
// GEMM's bits (which do not depend on the threads that run it), is fixed by the call's
// shapes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <numeric>
#include <queue>
#include <vector>

namespace groupgemm {
namespace cpu {

// A GEMM run alone on all threads is this much slower than a perfect split (measured
// with oneDNN on 2 threads: 1.92x one thread's speed, on a few hundred rows or more).
constexpr double kAloneScalingLoss = 0.05;

// Only GEMMs with at least this share of one thread's even load are worth running alone;
// it also bounds the choices weighed below.
constexpr double kAloneMinShare = 0.5;
constexpr size_t kMaxAlone = 16;

// The time of running work[first..] (sorted, largest first) side by side on `threads`
// threads, each taking the next GEMM when it is free: the busiest thread's total.
inline double side_by_side_time(const std::vector<double>& work, size_t first, int threads) {
  std::priority_queue<double, std::vector<double>, std::greater<double>> busy;
  for (int t = 0; t < threads; ++t) busy.push(0.0);
  double slowest = 0.0;
  for (size_t i = first; i < work.size(); ++i) {
    const double done = busy.top() + work[i];
    busy.pop();
    busy.push(done);
    slowest = std::max(slowest, done);
  }
  return slowest;
}

// For GEMMs of `work` (their FLOPs, sorted largest first) that may share the threads:
// how many of the largest run alone, first, one after another. The count with the least
// estimated time: the alone ones at kAloneScalingLoss over a perfect split, then the rest
// side by side (fewer GEMMs alone on a tie).
inline size_t gemms_run_alone(const std::vector<double>& work, int threads) {
  if (threads <= 1 || work.empty()) return 0;
  const double even = std::accumulate(work.begin(), work.end(), 0.0) / threads;
  size_t best = 0;
  double best_time = side_by_side_time(work, 0, threads), alone_time = 0.0;
  for (size_t alone = 1; alone <= std::min(work.size(), kMaxAlone); ++alone) {
    if (work[alone - 1] < kAloneMinShare * even) break;
    alone_time += work[alone - 1] * (1 + kAloneScalingLoss) / threads;
    const double time = alone_time + side_by_side_time(work, alone, threads);
    if (time < best_time) best = alone, best_time = time;
  }
  return best;
}

}  // namespace cpu
}  // namespace groupgemm
