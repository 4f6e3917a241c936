// Which work items rotate their tiles (tile_rotation in tile_slots.h): host side of the tree
// kernel's upload, no CUDA header.
//
// Rotation spreads the cold private tiles (folded leaves, read from DRAM once) of the units over
// the launch; it also desynchronizes the units' reads of their shared chunks, which then have to
// stay in L2 while the units run (PERF_NOTES.md, sessions 19-20). So it applies to all items with
// private pieces or to none, by the K/V bytes of their chunks:
//   kRotateOff       no item rotates;
//   kRotateVirtual   the distinct (vnode, kv_begin, kv_len) chunks' tokens (session 19's rule:
//                    a token of an ancestor is counted once per concatenated vnode holding it);
//   kRotatePhysical  the distinct KV slots those chunks read (each physical token once), and only
//                    when no two private pieces share a slot (a folded internal node re-read by
//                    its leaves' pieces: measured on the deep 32/8 trees, rotation then costs 3-6 %).
// Either way the items rotate iff the bytes are <= budget.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "plan/plan.h"

namespace fasttree::cuda_detail {

enum RotateMode : int { kRotateOff = 0, kRotateVirtual = 1, kRotatePhysical = 2 };

// Scratch of choose_rotation, reused across calls.
struct RotateScratch {
  std::vector<std::array<int64_t, 3>> chunks;        // (vnode, kv_begin, kv_len)
  std::vector<std::pair<int64_t, int64_t>> slots;    // [first, end) slot ranges
};

// Whether the items with private pieces rotate. bytes_per_token: K and V bytes of one token summed
// over the KV heads. slot_ranges(vnode, kv_begin, kv_len, emit) calls emit(first_slot, count) for
// the runs of consecutive slots holding those tokens (kRotatePhysical only).
template <class SlotRanges>
bool choose_rotation(const Plan& plan, int mode, int64_t bytes_per_token, int64_t budget, RotateScratch& scratch,
                     SlotRanges&& slot_ranges) {
  if (mode == kRotateOff) return false;
  auto& chunks = scratch.chunks;
  chunks.clear();
  for (const PlanItem& it : plan.items)
    if (it.priv_count > 0) chunks.push_back({it.vnode, it.kv_begin, it.kv_len});
  if (chunks.empty()) return false;
  std::sort(chunks.begin(), chunks.end());
  chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
  int64_t tokens = 0;
  auto& slots = scratch.slots;
  auto add_slots = [&](int64_t first, int64_t count) {
    if (count > 0) slots.emplace_back(first, first + count);
  };
  if (mode == kRotateVirtual) {
    for (const auto& c : chunks) tokens += c[2];
  } else {
    slots.clear();
    for (const auto& c : chunks)
      slot_ranges(static_cast<int>(c[0]), c[1], c[2], add_slots);
    std::sort(slots.begin(), slots.end());
    int64_t end = std::numeric_limits<int64_t>::min();  // union of the ranges
    for (const auto& [a, b] : slots) {
      if (b <= end) continue;
      tokens += b - std::max(a, end);
      end = b;
    }
  }
  if (tokens * bytes_per_token > budget) return false;
  if (mode == kRotatePhysical) {
    slots.clear();  // the private pieces' slots: any slot twice -> no rotation
    for (const PlanItem& it : plan.items)
      for (int32_t k = it.priv_begin; k < it.priv_begin + it.priv_count; ++k)
        slot_ranges(plan.privates[k].vnode, 0, plan.privates[k].len, add_slots);
    std::sort(slots.begin(), slots.end());
    for (size_t i = 1; i < slots.size(); ++i)
      if (slots[i].first < slots[i - 1].second) return false;
  }
  return true;
}

}  // namespace fasttree::cuda_detail
