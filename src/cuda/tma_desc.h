// Host-side encoding of TMA tensor-map descriptors (device_plan.h TmaDesc) for the K/V pools.
#pragma once
#include <cstdint>

#include "cuda/device_plan.h"

namespace fasttree::cuda_detail {

// Encodes `out` for a K or V pool at `base` ([S, Hkv, d] or [Hkv, S, d] 16-bit elements; element
// offset of (slot, head) = slot * row_stride + head * head_stride) as the 3-d tensor (d, slot,
// head) with boxes of 64 columns x box_slots slots x 1 head in the 128-byte swizzle. slots = S (<= 0:
// unknown; the tensor then spans 2^31 - 1 slots, and only slots inside real runs are ever read).
// Returns false (out untouched) where TMA cannot describe the pool: no driver entry point, a base
// or stride that is not 16-byte aligned, head_dim not a multiple of 64, or an encode error.
bool encode_kv_tma(TmaDesc& out, const void* base, bool bf16, int64_t head_dim, int64_t num_kv_heads, int64_t slots,
                   int64_t row_stride, int64_t head_stride, int box_slots);

// Encodes `out` for the queries q [Q, Hq, d] at `base` as the 3-d tensor (d, query head, query) with
// boxes of 64 columns x g heads x box_queries queries in the 128-byte swizzle: one box is the rows
// (query q0 + i, head h0 + j), row i * g + j, of a block of box_queries whole consecutive queries,
// laid out as the kernel's swz64 Q slot. Returns false (out untouched) where TMA cannot describe
// them (as encode_kv_tma, or g * box_queries > 256 rows).
bool encode_q_tma(TmaDesc& out, const void* base, bool bf16, int64_t head_dim, int64_t num_qo_heads, int64_t num_queries,
                  int g, int box_queries);

}  // namespace fasttree::cuda_detail
