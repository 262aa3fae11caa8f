#include "row_scratch.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

namespace groupgemm {
namespace cpu {
namespace {

struct Kept {
  std::unique_ptr<char[]> data;
  int64_t bytes;
};

struct Pool {
  std::mutex mutex;
  std::vector<Kept> kept;  // at most kKeptRowScratchBuffers
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: a lease may end during static destruction
  return *p;
}

}  // namespace

RowScratch::RowScratch(int64_t bytes) {
  if (bytes <= 0) return;
  {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mutex);
    auto best = p.kept.end();
    for (auto it = p.kept.begin(); it != p.kept.end(); ++it)
      if (it->bytes >= bytes && (best == p.kept.end() || it->bytes < best->bytes)) best = it;
    if (best != p.kept.end()) {
      data_ = std::move(best->data), bytes_ = best->bytes;
      p.kept.erase(best);
      return;
    }
  }
  data_.reset(new char[bytes]);  // default-initialized: no page is touched here
  bytes_ = bytes;
}

RowScratch::~RowScratch() {
  if (!data_ || bytes_ > kMaxKeptRowScratchBytes) return;
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  p.kept.push_back({std::move(data_), bytes_});
  if (p.kept.size() > size_t(kKeptRowScratchBuffers))  // the smallest goes
    p.kept.erase(std::min_element(p.kept.begin(), p.kept.end(),
                                  [](const Kept& x, const Kept& y) { return x.bytes < y.bytes; }));
}

void poison_kept_row_scratch() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  for (Kept& k : p.kept) std::memset(k.data.get(), 0xFF, size_t(k.bytes));
}

}  // namespace cpu
}  // namespace groupgemm
