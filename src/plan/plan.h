// Plan: the flat contract between the planner (CPU, no CUDA) and the executors (CPU reference
// executor, CUDA kernels). Plain arrays only, so it can be copied to fixed-capacity device buffers.
//
// Vocabulary (DESIGN.md §3):
//   virtual node (vnode)  a group of queries that read one contiguous piece of context together:
//                         the tokens of tree nodes top..node (a path), in root->leaf order.
//   segment               one tree node's tokens inside a vnode's context.
//   work item             (vnode, context chunk [kv_begin, kv_begin+kv_len), query tile, tile class).
//                         Items are head-agnostic: an executor runs every item once per KV head
//                         (num_kv_heads x items in all); a tile of q_count queries is q_count*g rows.
//   partial row           one fp32 output row [Hq, d] + LSE [Hq] written by an item for one of its
//                         queries. Query i of an item's tile writes row out_row + i, unless the
//                         query is direct (its whole path is covered by this one item), in which
//                         case the item writes the final output O[query] itself.
//   merge map             for each non-direct query, the partial rows to combine (LSE-weighted).
//   private piece         a folded leaf: the whole context of a one-query vnode (the query's own
//                         short leaf) carried by an item of another vnode whose tile holds that
//                         query, read after the item's chunk by that query's rows only. The leaf
//                         then needs no item and no partial row of its own (PlannerConfig::fold_max).
#pragma once
#include <array>
#include <cstdint>
#include <vector>

namespace fasttree {

// One query/KV tile shape the kernels are instantiated for.
struct TileClass {
  int q_rows = 64;   // query rows per tile (queries x GQA heads): the kernel's M
  int kv_tile = 64;  // KV tokens per tile: the kernel's N
};

inline constexpr int kMaxTileClasses = 4;

enum class EdgePolicy {
  kGreedy,   // paper Alg. 1 with the cost model below
  kAllZero,  // ablation "no greedy": every node is its own virtual node (split KV everywhere)
  kAllOne,   // ablation: every query re-reads its whole path (per-request grouping)
};

// Every constant of the planner. Defaults: `fasttree calibrate` on the H200 (bench/results/
// h200-calibration.csv; README "Calibration"; refitted 2026-12-01 on the fifteenth session's
// kernels, leaf folding and narrow mode on): alpha 1.5, beta 1, gamma 300, min_chunk 128,
// split_waves 2, tile classes 64 and 16 rows; fold_max 128 and its guards, and the narrow mode,
// from the A/B runs in src/cuda/PERF_NOTES.md.
struct PlannerConfig {
  // Cost model: Cmm(nQ, nK) = alpha*Pad(TSq, nQ)*g*nK + beta*max(0, TSk - nK)*nQ*g;
  // SplitKV pays gamma per query that gets one more partial result; SplitQ (concatenating a child
  // onto its parent's context) pays delta per parent-context token that the child's query tiles
  // read again (len_parent x tiles of the child's group), the KV traffic the paper's model leaves out.
  double alpha = 1.5;
  double beta = 1.0;
  double gamma = 300.0;
  double delta = 0.0;
  // Tile classes, any order; a vnode with R = nQ*g query rows uses the smallest class with
  // q_rows >= R, or the largest class when none is that large.
  std::array<TileClass, kMaxTileClasses> tile_classes{{{64, 64}, {16, 64}, {0, 0}, {0, 0}}};
  int num_tile_classes = 2;
  EdgePolicy edges = EdgePolicy::kGreedy;
  // Context splitting: chunks are made so that total work spreads over num_sms * split_waves
  // items of equal length, never shorter than min_chunk tokens (nor longer than max_chunk when
  // max_chunk > 0). split = false keeps every vnode's context in one chunk (ablation "no split").
  bool split = true;
  int num_sms = 132;
  double split_waves = 2.0;
  int64_t min_chunk = 128;
  int64_t max_chunk = 0;
  // Chunk balancing: for plans of a few rounds of units, the chunk length among a few multiples of
  // the split_waves one (x 0.75 .. 2) whose units finish first when num_sms x split_waves CTAs take
  // them longest first (planner.cpp, balance_chunk_target). E.g. `1 10 / 4000 400` at 32/8: 288
  // units of <= 256 tokens for 264 CTAs (24 run a second unit) become 264 units of <= 320.
  bool balance_chunks = true;
  // Segment alignment: each vnode's context lists the path segments whose lengths are whole KV
  // tiles first, then the others (attention does not depend on the token order), so that fewer
  // tiles straddle two KV runs (planner.cpp, align_segments). Off in the engine's decode planning,
  // whose plan extension appends each step's token to the vnode's last (the leaf's) segment.
  bool align_segments = true;
  // Leaf folding: a vnode whose group is one query at its own node, with at most fold_max context
  // tokens (one chunk), becomes a private piece of the last chunk's item, in the query's nearest
  // ancestor vnode, whose tile holds that query (0 = off; at most kMaxFoldTokens). Folding took
  // the paper suite on the H200 from 3.92 to 3.46x the floor (session 5: 32, 128 and 256 alike);
  // with the current kernels 256 beats 128 (the 256-token leaves of `1 4 16 64 256 1024`: 16/1
  // 71.5 -> 53.9 us, 32/8 341 -> 327; PERF_NOTES.md, session 21), hence the cap.
  int32_t fold_max = 256;
  // Folding is kept only where it pays (measured on the H200 paper suite, PERF_NOTES.md): into
  // query tiles of more than fold_min_rows rows, or into narrower tiles when their vnode's folded
  // leaves average at least fold_narrow_tokens per tile, and only when the plan keeps at least
  // fold_min_waves * num_sms items x KV heads (folding removes units: below that, the longer host
  // units become the critical path). fold_narrow_tokens was 128 while a 16-row host with one tile
  // of folded leaves ran slower on the main kernel than its leaves on the warp-per-unit kernel;
  // with the current kernels 0, 32 and 64 measure alike and 128 loses up to 19 % on the deep
  // GQA-1 trees (PERF_NOTES.md, session 21).
  int32_t fold_min_rows = 16;
  int32_t fold_narrow_tokens = 32;
  double fold_min_waves = 1.5;
  // Narrow mode (greedy edges only): when every query's path has at most narrow_max_path tokens,
  // GQA <= narrow_rows and the queries' rows (queries x Hq) fill at most narrow_max_waves x num_sms
  // tiles of narrow_rows rows, the plan uses narrow_rows-row query tiles only, folds leaves
  // regardless of fold_min_waves and splits contexts only when those tiles are fewer than
  // narrow_split_max_waves x num_sms. Small trees then run as one round of short units, mostly without
  // partial rows or a merge launch (shared prefixes are re-read per tile, from L2), instead of
  // dependent phases (64-row tiles of shared nodes, then leaf units, then the merge). H200 paper
  // suite, fp16: `1 256`, `1 2 64`, `1 4 256` at 32/32 and 32/8 1.2-1.3x faster, GQA-16 cells
  // 16.2 -> 15.8 .. 24.6 -> 24.3 us (src/cuda/PERF_NOTES.md). narrow_max_path = 0: off.
  int32_t narrow_rows = 16;
  int64_t narrow_max_path = 600;
  double narrow_max_waves = 4.0;
  // Narrow tiles that already occupy this share of the SMs are not split: the kernel's second CTA
  // per SM adds ~1.4x, not 2x (PERF_NOTES.md, session 12), so halving such tiles' paths does not pay
  // for the partial rows and the merge launch (`1 2 64 / 8 256 32` 32/8: 128 tiles of 200-token
  // halves + merge 19.2 us, unsplit 392-token tiles 17.6 us; at 16/1 its 64 tiles still gain from
  // splitting, 13.3 vs 13.9; H200, src/cuda/PERF_NOTES.md session 17).
  double narrow_split_max_waves = 0.75;
  // Narrow mode's wide tiles: at GQA <= narrow_wide_max_gqa, when tiles of narrow_wide_rows rows
  // still number at least narrow_wide_min_waves x num_sms, narrow mode uses them instead of
  // narrow_rows-row tiles: each shared prefix is re-read by half as many tiles, and on the H200
  // such blocks run as 64-row wgmma tiles (GQA < 8) instead of a 16-row mma.sync chain. H200 paper
  // suite, fp16: `1 256`, `1 4 256` and `1 4 8 256` 13-16 % faster at 32/8 and 2-8 % at 32/32; with
  // fewer tiles (`1 2 64`: 64 tiles of 32 rows) 13-27 % slower and at GQA 16 (two queries per tile,
  // 128 tiles) 2-13 % slower, hence both conditions (src/cuda/PERF_NOTES.md, session 25).
  // narrow_wide_rows = 0: off.
  int32_t narrow_wide_rows = 32;
  int32_t narrow_wide_max_gqa = 4;
  double narrow_wide_min_waves = 1.8;
  // At GQA >= mid_class_min_gqa the plan also gets a tile class of mid_class_rows query rows (when
  // the configured classes have none and a slot is free). Off by default since the kernel's tile
  // table took the run search out of the producer: with 32-row tiles at GQA 4 the suite measured
  // 2.73 vs 2.71 without (three deep 32/8 trees 15-17 % slower with them, `1 2 4 ... 1024 / 16 ...`
  // 32/8 13 % faster); before it, they had cut the deep 32/8 trees' times by 4-31 % (H200 paper
  // suite, src/cuda/PERF_NOTES.md sessions 7 and 14). mid_class_rows = 0: off.
  int32_t mid_class_rows = 0;
  int32_t mid_class_min_gqa = 4;
};

// The engine's decode planning: the defaults without the narrow mode and the mid tile class, which
// were measured on the kernel suite only (decode trees change every step and plans with folded leaves are re-planned
// instead of extended; not yet measured end to end). bench-e2e's --narrow-max-path turns it on.
inline PlannerConfig engine_planner_config() {
  PlannerConfig c;
  c.narrow_max_path = 0;
  c.mid_class_rows = 0;
  c.align_segments = false;
  // Measured end to end against the suite's 256 / 32 (PERF_NOTES.md, session 22): llama2-7b even,
  // mistral-7b's attention 3-4 % slower on workloads A and D with 256 / 32.
  c.fold_max = 128;
  c.fold_narrow_tokens = 128;
  return c;
}

inline constexpr int32_t kMaxFoldTokens = 256;
inline constexpr int kDefaultKvTile = 64;  // KV tokens per tile of the classes the planner adds (narrow mode, mid class)

struct PlanSegment {
  int64_t slot_offset;  // index into KvTree::slots of the segment's first token
  int32_t token_begin;  // offset of the segment inside its vnode's context
  int32_t len;          // tokens (> 0; empty tree nodes produce no segment)
};

struct PlanItem {
  int32_t vnode;
  int32_t kv_begin;    // first context token (vnode coordinates)
  int32_t kv_len;      // > 0
  int32_t q_begin;     // index into Plan::vnode_queries
  int32_t q_count;     // queries in this tile (rows = q_count * g)
  int32_t tile_class;  // index into PlannerConfig::tile_classes
  int32_t out_row;     // partial row of the tile's first query
  int32_t priv_begin = 0;  // private pieces [priv_begin, priv_begin + priv_count) of Plan::privates
  int32_t priv_count = 0;
  int32_t priv_len = 0;    // their tokens in all (the item reads kv_len + priv_len tokens)
};

// A folded leaf inside an item (see "private piece" above): the whole context of vnode `vnode`,
// read by query q_index of the item's tile only, at offsets [token_begin, token_begin + len) of the
// item's private region (which follows the chunk). An item's pieces are ordered by q_index and
// tile the region.
struct PlanPrivate {
  int32_t vnode;
  int32_t q_index;
  int32_t token_begin;
  int32_t len;  // == vnode_len[vnode]
};

// Tokens an item reads: its chunk plus its private pieces (the planner's longest-first order).
inline int64_t item_tokens(const PlanItem& it) { return int64_t{it.kv_len} + it.priv_len; }

struct Plan {
  int num_queries = 0;
  int num_qo_heads = 0;
  int num_kv_heads = 0;
  std::array<TileClass, kMaxTileClasses> tile_classes{};
  int num_tile_classes = 0;

  // Virtual nodes.
  std::vector<int32_t> vnode_node;       // [V] lowest tree node of the vnode's context
  std::vector<int32_t> vnode_len;        // [V] context tokens
  std::vector<int32_t> vnode_seg_begin;  // [V+1] CSR into segments
  std::vector<PlanSegment> segments;
  std::vector<int32_t> vnode_q_begin;    // [V+1] CSR into vnode_queries
  std::vector<int32_t> vnode_queries;    // query ids of each vnode's group

  // Work items, longest (item_tokens) first, and their private pieces.
  std::vector<PlanItem> items;
  std::vector<PlanPrivate> privates;
  std::array<int32_t, kMaxTileClasses> items_per_class{};

  // Merge map.
  int32_t num_partial_rows = 0;
  std::vector<uint8_t> query_direct;     // [Q] 1: a single item writes O[q] directly
  std::vector<int32_t> merge_begin;      // [Q+1] CSR into merge_rows (empty for direct queries)
  std::vector<int32_t> merge_rows;

  // Planner decisions, kept for inspection and tests: edge of each tree node to its parent
  // (1 = concatenated into the child's vnode), and the vnode id of each node (-1 = no work).
  std::vector<uint8_t> node_edge;
  std::vector<int32_t> node_vnode;

  int num_vnodes() const { return static_cast<int>(vnode_node.size()); }
  int num_items() const { return static_cast<int>(items.size()); }
  int g() const { return num_kv_heads > 0 ? num_qo_heads / num_kv_heads : 0; }
};

}  // namespace fasttree
