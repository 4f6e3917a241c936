// SlotPool implementation: free-list stack + in-use bitmap (see slot_pool.h).
#include "core/slot_pool.h"

#include <string>

#include "core/error.h"

namespace fasttree {

SlotPool::SlotPool(int32_t capacity) : capacity_(capacity) {
  FT_CHECK(capacity >= 0, "SlotPool: negative capacity " + std::to_string(capacity));
  free_list_.resize(capacity);
  // Reverse order so that pops from the back hand out 0, 1, 2, ...
  for (int32_t i = 0; i < capacity; ++i) free_list_[i] = capacity - 1 - i;
  in_use_.assign(capacity, 0);
}

std::vector<int32_t> SlotPool::alloc(int64_t n) {
  std::vector<int32_t> out;
  if (!try_alloc(n, out))
    FT_FAIL("KV pool exhausted: requested " + std::to_string(n) + " slots, " + std::to_string(num_free()) +
            " free (capacity " + std::to_string(capacity_) + ")");
  return out;
}

bool SlotPool::try_alloc(int64_t n, std::vector<int32_t>& out) {
  FT_CHECK(n >= 0, "SlotPool: cannot allocate a negative number of slots (" + std::to_string(n) + ")");
  if (n > static_cast<int64_t>(free_list_.size())) return false;
  out.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t s = free_list_.back();
    free_list_.pop_back();
    in_use_[s] = 1;
    out[i] = s;
  }
  return true;
}

void SlotPool::free(std::span<const int32_t> slots) {
  // Pass 1: validate and clear the bitmap; on an error restore what was cleared, then throw.
  for (size_t i = 0; i < slots.size(); ++i) {
    const int32_t s = slots[i];
    const bool in_range = s >= 0 && s < capacity_;
    if (!in_range || !in_use_[s]) {
      for (size_t j = 0; j < i; ++j) in_use_[slots[j]] = 1;
      if (!in_range)
        FT_FAIL("SlotPool::free: slot " + std::to_string(s) + " out of range [0, " + std::to_string(capacity_) +
                ")");
      FT_FAIL("SlotPool::free: double free of slot " + std::to_string(s) + " (not in use)");
    }
    in_use_[s] = 0;
  }
  // Pass 2: push onto the free list, last slot first: the next alloc hands them out in the order
  // given (runs of consecutive slots stay runs, which the attention kernels read fastest).
  for (auto it = slots.rbegin(); it != slots.rend(); ++it) free_list_.push_back(*it);
}

}  // namespace fasttree
