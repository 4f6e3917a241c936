// The tile table of a BlockRecord (device_plan.h: tile_slot, tile_box) from a block's runs. Host
// code only (no CUDA header), so that it is unit-tested on machines without a GPU.
#pragma once
#include <algorithm>
#include <cstdint>

#include "cuda/device_plan.h"

namespace fasttree::cuda_detail {

// Fills rec.tile_slot / rec.tile_box from the block's segment runs [rb, re) (sorted by token_begin;
// rb holds token rec.desc.kv_begin). Tile t = tokens [kv_begin + 64 t, + count), count = min(64,
// kv_len - 64 t):
//   - a full tile inside one run gets its first slot;
//   - else, while box entries are left, a tile whose every 8-row unit (rows [8 u, min(8 u + 8,
//     count))) lies inside one run gets entry e: tile_slot[t] = -2 - e, tile_box[e][u] = the slot
//     of row 8 u (units past the count: -1);
//   - else -1 (also for slots that TMA's int32 coordinates cannot hold).
inline void fill_tile_slots(BlockRecord& rec, const DeviceRun* rb, const DeviceRun* re) {
  constexpr int kUnits = kKvTile / 8;
  constexpr int64_t kMaxSlot = INT32_MAX - kKvTile;
  std::fill(rec.tile_slot, rec.tile_slot + kRecordTiles, int32_t{-1});
  std::fill(&rec.tile_box[0][0], &rec.tile_box[0][0] + kRecordBoxTiles * kUnits, int32_t{-1});
  const DeviceRun* r = rb;
  // Slot of token tok when tokens [tok, end) lie in one run, else -1 (r only moves forward: tokens
  // are asked for in increasing order).
  auto slot_of = [&](int64_t tok, int64_t end) -> int64_t {
    while (r + 1 < re && r[1].token_begin <= tok) ++r;
    if (r >= re || r->token_begin > tok || end > static_cast<int64_t>(r->token_begin) + r->len) return -1;
    const int64_t slot = r->slot + (tok - r->token_begin);
    return slot >= 0 && slot <= kMaxSlot ? slot : -1;
  };
  int boxes = 0;
  for (int t = 0; t < kRecordTiles && rb < re; ++t) {
    const int64_t off = static_cast<int64_t>(t) * kKvTile;
    if (off >= rec.desc.kv_len) break;
    const int count = static_cast<int>(std::min<int64_t>(kKvTile, rec.desc.kv_len - off));
    const int64_t first = static_cast<int64_t>(rec.desc.kv_begin) + off;
    if (count == kKvTile) {
      const int64_t slot = slot_of(first, first + kKvTile);  // r now holds `first`, where the units below start
      if (slot >= 0) {
        rec.tile_slot[t] = static_cast<int32_t>(slot);
        continue;
      }
    }
    if (boxes == kRecordBoxTiles) continue;
    int32_t unit_slot[kUnits];
    bool ok = true;
    for (int u = 0; u < kUnits; ++u) {
      unit_slot[u] = -1;
      if (8 * u >= count) continue;
      const int64_t slot = slot_of(first + 8 * u, first + std::min(8 * u + 8, count));
      if (slot < 0) {
        ok = false;
        break;
      }
      unit_slot[u] = static_cast<int32_t>(slot);
    }
    if (!ok) continue;
    std::copy(unit_slot, unit_slot + kUnits, rec.tile_box[boxes]);
    rec.tile_slot[t] = -2 - boxes;
    ++boxes;
  }
}

// First tile (0 .. 63) of block number `block` whose table rec (fill_tile_slots) describes every
// tile: its tiles then run from that tile to the last and on from tile 0, which the producer
// issues from the table alone (a tile outside the table would need the forward-only run search:
// 0 for those blocks). Consecutive blocks start spread over the block's tiles (a stride of 37
// tiles), so that the cold private tiles at the end of every unit (folded leaves) are not read
// from DRAM by all CTAs at once.
inline int32_t tile_rotation(const BlockRecord& rec, int64_t block) {
  const int64_t ntiles = (static_cast<int64_t>(rec.desc.kv_len) + kKvTile - 1) / kKvTile;
  if (ntiles <= 1 || ntiles > kRecordTiles) return 0;
  for (int64_t t = 0; t < ntiles; ++t)
    if (rec.tile_slot[t] == -1) return 0;
  return static_cast<int32_t>((block * 37) % ntiles);
}

}  // namespace fasttree::cuda_detail
