// A map of at most `capacity` entries that evicts the least recently used one, for
// concurrent callers. Values are created once per key (under the lock) and handed out
// as shared_ptr: an entry evicted while another thread still uses it stays alive until
// that thread lets it go.
#pragma once

#include <cstddef>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace groupgemm {
namespace cpu {

template <typename Key, typename Value>
class LruCache {
 public:
  explicit LruCache(size_t capacity) : capacity_(capacity) {}

  // The value cached for `key`, or the one make() returns, cached now. If make() throws,
  // nothing is cached.
  template <typename Make>
  std::shared_ptr<const Value> get(const Key& key, Make&& make) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = index_.find(key);
    if (found != index_.end()) {
      recent_.splice(recent_.begin(), recent_, found->second);  // now the most recent
      return found->second->second;
    }
    auto value = std::make_shared<const Value>(make());
    recent_.emplace_front(key, value);
    index_.emplace(key, recent_.begin());
    if (recent_.size() > capacity_) {
      index_.erase(recent_.back().first);
      recent_.pop_back();
    }
    return value;
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return recent_.size();
  }

 private:
  using Entry = std::pair<Key, std::shared_ptr<const Value>>;
  const size_t capacity_;
  mutable std::mutex mutex_;
  std::list<Entry> recent_;  // most recently used first
  std::map<Key, typename std::list<Entry>::iterator> index_;
};

}  // namespace cpu
}  // namespace groupgemm
