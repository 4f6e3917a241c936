// BlockRecord::tile_slot (device_plan.h) from a block's runs. Host code only (no CUDA header), so
// that it is unit-tested on machines without a GPU.
#pragma once
#include <algorithm>
#include <cstdint>

#include "cuda/device_plan.h"

namespace fasttree::cuda_detail {

// Fills rec.tile_slot from the block's segment runs [rb, re) (sorted by token_begin; rb holds token
// rec.desc.kv_begin): tile t = tokens [kv_begin + t kKvTile, + kKvTile) gets its first slot when the
// tile is full (inside kv_len) and lies in one run, else -1 (a partial tile, a tile across runs, or
// a slot range beyond int32, which the TMA coordinates cannot hold).
inline void fill_tile_slots(BlockRecord& rec, const DeviceRun* rb, const DeviceRun* re) {
  std::fill(rec.tile_slot, rec.tile_slot + kRecordTiles, int32_t{-1});
  const DeviceRun* r = rb;
  for (int t = 0; t < kRecordTiles && r < re; ++t) {
    if (static_cast<int64_t>(t + 1) * kKvTile > rec.desc.kv_len) break;  // this tile and the later ones are not full
    const int64_t first = static_cast<int64_t>(rec.desc.kv_begin) + static_cast<int64_t>(t) * kKvTile;
    while (r + 1 < re && r[1].token_begin <= first) ++r;
    if (r->token_begin > first || first + kKvTile > static_cast<int64_t>(r->token_begin) + r->len) continue;
    const int64_t slot = r->slot + (first - r->token_begin);
    if (slot >= 0 && slot + kKvTile <= INT32_MAX) rec.tile_slot[t] = static_cast<int32_t>(slot);
  }
}

}  // namespace fasttree::cuda_detail
