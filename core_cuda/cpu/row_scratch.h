// The CPU fused expert MLP's [T*k, H] scratch rows (expert outputs in the forward, the input
// gradients' rows in the backward), kept from one call to the next. A fresh buffer of that
// size comes straight from mmap and takes a page fault per 4 KiB on its first write, every
// call: 5-17% of a forward+backward (docs/benchmarks.md). So the CPU backend uses these,
// and the caller's scratch (expert_rows, token_rows: the CUDA backend's, allocated by the
// frontends) stays untouched there, costing no memory.
#pragma once

#include <cstdint>
#include <memory>

namespace groupgemm {
namespace cpu {

// Scratch released by its lease is kept for later calls: at most this many buffers of at
// most this many bytes each (larger ones are freed), so a process holds at most 512 MiB
// of it.
constexpr int kKeptRowScratchBuffers = 2;
constexpr int64_t kMaxKeptRowScratchBytes = int64_t(256) << 20;

// A buffer of at least `bytes` bytes (its contents undefined) for the lease's lifetime: the
// smallest kept one that is large enough, else a new one. Thread-safe.
class RowScratch {
 public:
  explicit RowScratch(int64_t bytes);
  ~RowScratch();
  RowScratch(const RowScratch&) = delete;
  RowScratch& operator=(const RowScratch&) = delete;

  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data_.get());
  }

 private:
  std::unique_ptr<char[]> data_;
  int64_t bytes_ = 0;
};

// For the tests: fills every kept buffer with 0xFF bytes (a NaN in every float dtype), so
// that a row read before the call writes it shows in the results.
void poison_kept_row_scratch();

}  // namespace cpu
}  // namespace groupgemm
