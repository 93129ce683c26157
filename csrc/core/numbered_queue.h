// NumberedQueue: items numbered in the order they were pushed, the oldest
// dropped once no longer needed (trace marks, fences): number base + i is the
// i-th item kept. The Backend's host trace marks and CudaBackend's events use it.
#pragma once
#include <cstdint>
#include <deque>

namespace mgpu {

template <typename T>
class NumberedQueue {
 public:
  uint64_t push(T item) {
    items_.push_back(item);
    return base_ + items_.size() - 1;
  }
  // The item numbered `number`, or null once dropped (or never pushed).
  const T* find(uint64_t number) const {
    return number >= base_ && number - base_ < items_.size() ? &items_[number - base_] : nullptr;
  }
  bool dropped(uint64_t number) const { return number < base_; }
  // Drops the items numbered below `number`, handing each to release first.
  template <typename Release>
  void drop_before(uint64_t number, Release&& release) {
    while (base_ < number && !items_.empty()) {
      release(items_.front());
      items_.pop_front();
      ++base_;
    }
  }
  void drop_before(uint64_t number) {
    drop_before(number, [](const T&) {});
  }
  const std::deque<T>& items() const { return items_; }
  void clear() { items_.clear(); }

 private:
  std::deque<T> items_;
  uint64_t base_ = 0;
};

}  // namespace mgpu
