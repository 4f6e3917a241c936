// Device-side form of a Plan (plan/plan.h) and the parameter structs of the CUDA kernels. Plain C++
// with no CUDA header: built on the host by tree_attention.cpp, read by the kernels.
//
// The kernel's unit of work is (block, kv head): a block is one work item's query tile, or a
// 64-row slice of it when the tile has more than 64 rows (q_count * g > 64 only happens with tile
// classes above 64 rows). unit u = block u / Hkv, kv head u % Hkv, so the plan's longest-first item
// order is kept. A block's rows (row = query_index * g + head_in_group) select the kernel's tile
// class: rows <= 16 use one 16-row group (the 4 warps split each KV tile's columns), rows <= 32 two
// (2 warps per group), else four (each warp 16 rows, all columns).
//
// KV slots reach the kernel as *runs*: upload() cuts every plan segment (one tree node's tokens in a
// vnode's context) into maximal runs of consecutive KV slots, so token j of a run sits in slot
// run.slot + j and the kernel never reads the per-token slot list. Tree nodes built on consecutive
// slots (or pages) give a few long runs; arbitrary slot lists still work (runs of one token).
#pragma once
#include <cstddef>
#include <cstdint>

namespace fasttree::cuda_detail {

inline constexpr int kKvTile = 64;        // KV tokens per pipeline stage (the kernel's N)
inline constexpr int kMaxBlockRows = 64;  // rows of the largest query tile (the kernel's M)

struct BlockDesc {
  int32_t seg_first;    // run (index into the run array) holding context token kv_begin
  int32_t seg_end;      // one past the vnode's last run
  int32_t kv_begin;     // chunk [kv_begin, kv_begin + kv_len) in vnode context coordinates
  int32_t kv_len;       // > 0: chunk tokens plus private tokens
  int32_t shared_len;   // the first shared_len tokens are read by every row; tokens [shared_len,
                        // kv_len) are private pieces (folded leaves): row r reads only
                        // BlockRecord::priv[r]'s interval of them
  int32_t row0;         // first row of this block inside the item's tile
  int32_t rows;         // rows of this block, 1..64
  int32_t row_groups;   // bits 0-7: 1, 2 or 4 groups of 16 rows (tile class of the kernel;
                        // row_groups_of); bits 8-15: the tile the unit starts at (0 .. 63; its tiles
                        // run from there to the last and on from tile 0; upload() sets it only where
                        // the tile table describes every tile, tile_rotation in tile_slots.h, and the
                        // producer applies it only with the table and TMA); bit 16 (kQRunBit):
                        // the rows are whole consecutive queries (row r = query q0 + r / g, head
                        // r % g of the kv head's group; row0 % g == 0), so the kernels with Q slots
                        // load them as one TMA box per 64 columns (TreeAttnParams::tma_q64 / q16)
};
inline constexpr int32_t kQRunBit = 1 << 16;
static_assert(sizeof(BlockDesc) == 32);

// Row groups of a block of `rows` rows: 1 up to 16 rows (mma.sync, the 4 warps splitting each tile
// by columns), 2 up to 32 (2 x 2 warps on mma.sync), else 4 (64-row tiles, on wgmma at d <= 128).
// wide_only: the kernel has no 2-group path (the 3-stage kernel, TreeKernelConfig::kQGlobal):
// 17-32 rows run as a 64-row tile, the rows past the block computed and not stored.
// min_groups (1, 2 or 4; CudaTreeAttention's FT_MIN_ROW_GROUPS A/B knob): the smallest class used,
// e.g. 4 runs every block as a 64-row tile, its missing rows computed and not stored.
inline bool valid_min_row_groups(int32_t min_groups) { return min_groups == 1 || min_groups == 2 || min_groups == 4; }
inline int32_t row_groups_of(int32_t rows, bool wide_only, int32_t min_groups = 1) {
  const int32_t g = rows <= 16 ? 1 : (rows <= 32 && !wide_only ? 2 : 4);
  return g > min_groups ? g : min_groups;
}

// Per (item, query of its tile): the query id and where its result goes: dst >= 0 is the final
// output row O[dst] (a direct query), dst < 0 the partial row ~dst (= -dst - 1), which the merge
// kernel combines.
struct QueryInfo {
  int32_t query;
  int32_t dst;
};
static_assert(sizeof(QueryInfo) == 8);

// A run of consecutive KV slots: context tokens [token_begin, token_begin + len) of a vnode sit in
// slots slot .. slot + len - 1.
struct DeviceRun {
  int64_t slot;
  int32_t token_begin;
  int32_t len;
};
static_assert(sizeof(DeviceRun) == 16);

// Everything the kernel's producer needs to start a block, in one fixed-size record so that a
// single gather (cp.async of kRecordBytes into a shared-memory ring, several units ahead) brings
// it: the descriptor, the vnode's runs from desc.seg_first on (up to 32; the producer reloads
// further windows from the run array), and the QueryInfo of each block row (row r of the block:
// query (row0 + r) / g of the item's tile), and the private-region ends of its queries. Unused
// entries are zero. A block with private pieces has its own run list: the chunk's runs (context
// tokens [kv_begin, kv_begin + shared_len)) followed by its pieces' runs at
// [kv_begin + shared_len, kv_begin + kv_len), query by query. The tile table (computed at upload,
// so that the producer skips the run search and copies by TMA; the two arrays are the record's
// last fields) describes tile t < kRecordTiles (tokens [kv_begin + 64 t, + min(64, kv_len - 64 t))):
//   tile_slot[t] >= 0   the tile is kKvTile tokens inside one run, from that slot (one TMA box);
//   tile_slot[t] <= -2  tile_box[-2 - tile_slot[t]][u] is the slot of the tile's row 8 u for each
//                       8-row unit u < ceil(count / 8), each unit inside one run (TMA boxes of 8
//                       or 16 rows; a last unit of fewer than 8 rows by cp.async);
//   tile_slot[t] == -1  none of these (the producer searches the runs).
// Slots in the table are below INT32_MAX - 64 (TMA coordinates are int32).
inline constexpr int kRecordRuns = 32;
inline constexpr int kRecordTiles = 64;
inline constexpr int kRecordBoxTiles = 16;  // tiles per record described by 8-row units
inline constexpr int kMaxPrivateTokens = 0x7fff;
struct BlockRecord {
  BlockDesc desc;
  DeviceRun runs[kRecordRuns];
  QueryInfo rows[kMaxBlockRows];
  // Query j of the block (j = (row0 + r) / g - row0 / g for row r) reads private tokens
  // [j > 0 ? priv_end[j - 1] : 0, priv_end[j]) (counted from shared_len); all zero without pieces.
  uint16_t priv_end[kMaxBlockRows];
  int32_t tile_slot[kRecordTiles];
  int32_t tile_box[kRecordBoxTiles][kKvTile / 8];
};
inline constexpr int kRecordBytes = static_cast<int>(sizeof(BlockRecord));
// Records each CTA gathers before it knows the unit count (TreeKernelConfig::kLook <= this): the
// record array has at least kMaxRecordLook x grid entries.
inline constexpr int kMaxRecordLook = 5;
static_assert(kRecordBytes == 1952 && kRecordBytes % 16 == 0);
// The kernel's record slots may drop the tile table (TreeKernelConfig::kRecSlotBytes): it is last.
inline constexpr int kRecordTableBytes = static_cast<int>(sizeof(BlockRecord::tile_slot) + sizeof(BlockRecord::tile_box));
static_assert(offsetof(BlockRecord, tile_slot) + kRecordTableBytes == sizeof(BlockRecord));

// Counts read by the kernels from device memory, so that a captured graph stays valid when a new
// plan is uploaded into the same buffers.
struct DeviceCounts {
  int32_t num_units;      // units of the main tree kernel: [0, num_units)
  int32_t num_merge;      // non-direct queries (those with no partial row, empty paths, get O = 0, LSE = -inf)
  int32_t num_all_units;  // blocks x kv heads; [num_units, num_all_units) run on the warp-per-unit kernel
};

#ifndef FT_TRACE  // -DFT_TRACE=1 (CMake -DFASTTREE_TRACE=ON): kernels with timeline marks
#define FT_TRACE 0
#endif

// Diagnostics (cuda/trace.cuh, builds with FT_TRACE only): trace[kind][cta][event] holds %globaltimer
// stamps in ns, 0 = not reached; kinds and events below.
inline constexpr int kTraceCtas = 2048;
inline constexpr int kTraceEvents = 40;
enum TraceKind { kTraceTree = 0, kTraceMerge = 1, kTraceKinds = 2 };
enum TraceTreeEvent {
  kTrStart = 0,        // producer: kernel entry
  kTrRecords = 1,      // producer: the prologue's block records landed
  kTrFirstIssue = 2,   // producer: the first tile's loads issued
  kTrFirstFull = 3,    // consumer warp 0: the first tile's data arrived (full barrier)
  kTrFirstUnit = 4,    // consumer warp 0: the first unit's rows written
  kTrConsumerEnd = 5,  // consumer warp 0: no more tiles
  kTrProducerEnd = 6,  // producer: done (after the work-counter bookkeeping)
  kTrFirstRecord = 7,  // producer: the first unit's record read (shared -> registers)
  kTrFirstQ = 8,       // producer: the first unit's Q loads issued
  kTrFirstKvBegin = 9,  // producer: the first tile's K/V slots resolved, before its copies
  kTrFirstKvEnd = 10,   // producer: the first tile's K/V copies issued (before its publish)
  // Durations (ns summed over the CTA's run, not stamps; stored once at the end, trace_put):
  kTrConsWaitNs = 11,   // consumer warp 0: waiting on full barriers
  kTrConsTiles = 12,    // consumer warp 0: tiles consumed (a count)
  kTrProdWaitNs = 13,   // producer: waiting on empty barriers
  kTrProdIssueNs = 14,  // producer: issuing a tile (Q, K/V copies, publish)
  // The producer's issue split into its steps, in SM cycles (clock64; summed like the above):
  kTrProdRecordCy = 15,  // reading a new unit's block record (shared -> registers)
  kTrProdQCy = 16,       // a unit's Q rows and row tables (issue_q)
  kTrProdSearchCy = 17,  // a tile's slot-run window: ensure_window + window_search
  kTrProdCopyCy = 18,    // a tile's K/V copies after the search (TMA / cp.async issue)
  kTrProdPublishCy = 19, // publish (meta, arrivals) and the next record's gather
  kTrConsTileCy = 20,    // consumer warp 0: a tile from its full barrier to its release
  // The copy step of tiles loaded from the record's tile table (expect_tx + TMA by lane 0), cycles:
  kTrProdTableCy = 21,     // summed
  kTrProdTableTiles = 22,  // how many (a count)
  kTrProdTableMinCy = 23,  // the fastest one
  kTrProdTableMaxCy = 24,  // the slowest one
  kTrProdTableFirstCy = 25, // the CTA's first one
  // The copy step (after the window search) of the other tiles, by path, cycles and counts:
  kTrProdPartialCy = 26,  // a partial tile inside one run (16-row TMA chunks, cp.async, zero rows)
  kTrProdPartialN = 27,
  kTrProdSlowCy = 28,     // a tile across runs (per-row slot search, chunks, cp.async)
  kTrProdSlowN = 29,
  kTrProdPastCy = 30,     // a full one-run tile past the record's tile table (TMA)
  kTrProdPastN = 31,
  kTrProdPartialMinCy = 32,  // the fastest partial tile's copy step
  kTrProdSlowMinCy = 33,     // the fastest cross-run tile's copy step
  kTrProdQRowsCy = 34,       // issue_q's row tables (summed), the rest of kTrProdQCy is its copies
  kTrProdBoxCy = 35,         // tiles of 8-row units from the record's tile table (tile_box)
  kTrProdBoxN = 36,
  kTrProdBoxMinCy = 37,
};
enum TraceMergeEvent { kTrMergeStart = 0, kTrMergeWaited = 1, kTrMergeEnd = 2 };

// Tree-attention kernel: q [Q, Hq, d], k/v [S, Hkv, d] or [Hkv, S, d] (dtype T; kv strides below), out [Q, Hq, d] fp32,
// lse [Q, Hq] fp32 (may be null), partial [rows, Hq, d] fp32, partial_lse [rows, Hq] fp32.
// A TMA tensor-map descriptor (CUtensorMap: 128 opaque bytes, 64-byte aligned), held by value in
// the kernel parameters (the kernels take them as __grid_constant__). Encoded by tma_desc.cpp.
struct alignas(64) TmaDesc {
  unsigned long long raw[16];
};

struct TreeAttnParams {
  // K and V pools as 3-d tensors (d, slot, kv head) with 64-column x 64-slot boxes in the 128-byte
  // swizzle of the shared K/V tiles; the producer loads a full tile that lies in one slot run with
  // D / 32 TMA copies instead of cp.async. use_tma = 0: cp.async only (no descriptors).
  TmaDesc tma_k;
  TmaDesc tma_v;
  // The same pools with 64-column x 16-slot and x 8-slot boxes: the 16-row chunks of other tiles
  // (partial, or over several runs) whose slots are consecutive, and the 8-row units of tiles in
  // the record's tile table.
  TmaDesc tma_k16;
  TmaDesc tma_v16;
  TmaDesc tma_k8;
  TmaDesc tma_v8;
  int use_tma;
  // The queries as a 3-d tensor (d, query head, query) with 64-column x g-head boxes of 64 / g
  // (tma_q64) and 16 / g (tma_q16) queries: the Q rows of a block with BlockDesc kQRunBit, up to
  // 64 rows (16 rows: tma_q16), straight into its Q slot. use_tma_q: bit 0 tma_q64 valid, bit 1
  // tma_q16 valid (0: cp.async only).
  TmaDesc tma_q64;
  TmaDesc tma_q16;
  int use_tma_q;

  const void* q;
  const void* k;
  const void* v;
  float* out;
  float* lse;
  float* partial;
  float* partial_lse;
  const DeviceCounts* counts;
  const BlockRecord* records;  // [blocks], >= kMaxRecordLook x gridDim.x entries (the first units' are read blind)
  const DeviceRun* runs;
  // Work counter [2] (claims, CTAs done), zero at launch; the last CTA to finish resets it for the
  // next launch. nullptr = static round-robin over units.
  int* work_counter;
  int num_qo_heads;
  int num_kv_heads;
  int gqa;
  float scale_log2;  // sm_scale * log2(e)
  // K/V element offset of (slot, kv head): slot * kv_row_stride + kv_head * kv_head_stride.
  // Slot-major [S, Hkv, d]: Hkv * d and d; head-major [Hkv, S, d]: d and S * d.
  int64_t kv_row_stride;
  int64_t kv_head_stride;
  unsigned long long* trace;  // [kTraceKinds][kTraceCtas][kTraceEvents] or nullptr (FT_TRACE builds)
};

// Merge kernel: for each non-direct query q = merge_queries[i] and head h, the LSE-weighted
// combination of partial rows merge_rows[merge_begin[q] .. merge_begin[q+1]) -> out[q, h], lse[q, h].
struct MergeParams {
  const DeviceCounts* counts;
  const int32_t* merge_queries;  // [num_merge]
  const int32_t* merge_begin;    // [Q + 1]
  const int32_t* merge_rows;
  const float* partial;
  const float* partial_lse;
  float* out;
  float* lse;  // may be null
  int num_qo_heads;
  unsigned long long* trace;  // as TreeAttnParams::trace
};

}  // namespace fasttree::cuda_detail
