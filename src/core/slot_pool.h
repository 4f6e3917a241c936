// SlotPool: allocator of KV-pool slots [0, capacity) (one slot = one token's K/V row, DESIGN.md §2).
// A LIFO free list plus an in-use bitmap: alloc and free are O(1) per slot, and every misuse
// (exhaustion, out-of-range slot, double free) throws fasttree::Error without changing the pool.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace fasttree {

class SlotPool {
 public:
  explicit SlotPool(int32_t capacity);

  // Returns n free slots (a fresh pool hands them out in ascending order). Throws
  // "KV pool exhausted: requested N slots, M free (capacity C)" and allocates nothing when fewer
  // than n are free.
  std::vector<int32_t> alloc(int64_t n);
  // Like alloc, but returns false (leaving `out` untouched) instead of throwing on exhaustion. On
  // success `out` holds exactly the n slots (its capacity is reused, so steady state is
  // allocation-free).
  bool try_alloc(int64_t n, std::vector<int32_t>& out);
  // Returns slots to the pool; the next alloc of as many slots returns them in this order. Throws,
  // freeing nothing, if any slot is out of range or not in use (a double free, also within the same
  // call).
  void free(std::span<const int32_t> slots);

  int32_t num_free() const { return static_cast<int32_t>(free_list_.size()); }
  int32_t num_used() const { return capacity_ - num_free(); }
  int32_t capacity() const { return capacity_; }
  // True when `slot` is in range and currently allocated.
  bool is_in_use(int32_t slot) const { return slot >= 0 && slot < capacity_ && in_use_[slot] != 0; }

 private:
  int32_t capacity_;
  std::vector<int32_t> free_list_;  // top of the stack = back
  std::vector<uint8_t> in_use_;     // [capacity]
};

}  // namespace fasttree
