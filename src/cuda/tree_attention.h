// CudaTreeAttention: executes a Plan (plan/plan.h) on the GPU with the tree-attention kernel
// (tree_attention_kernel.cuh) and the merge kernel (merge_kernel.cuh). No CUDA header here.
//
//   CudaTreeAttention att(shape, KvDType::kBF16);
//   att.upload(plan, tree, stream);                       // once per plan
//   att.run(q, k, v, out, lse, stream);                   // device pointers; capturable in a graph
//
// Tensors (device memory, layouts of core/attention_shape.h):
//   q [Q, Hq, d], k/v [S, Hkv, d] (or [Hkv, S, d]: options.kv_layout) in the dtype given at
//   construction (fp16 or bf16)
//   out [Q, Hq, d] fp32, lse [Q, Hq] fp32 natural-log LSE (nullptr: not written)
// Output is fp32 (the partials and the merge are fp32 anyway; a 16-bit output is a later option).
//
// Buffers: the plan lives in one device arena of fixed-capacity sections, the partial results in a
// workspace; both only grow (no allocation once they fit the largest plan seen). upload() packs the
// plan into pinned host memory (cutting its segments into runs of consecutive KV slots) and copies
// it with one asynchronous memcpy on the given stream; the next upload() waits for that copy.
// run() enqueues the tree kernel, then (for plans with partial rows) the merge kernel as its
// programmatic dependent, with counts read from device memory; the kernels leave their counters at zero for the
// next launch, so there is no memset. run() never allocates or synchronizes, so it can be
// captured in a CUDA graph, and a graph captured once stays valid across uploads as long as
// graph_epoch() is unchanged (it changes when buffers move or the launch sequence changes, and,
// with Q loaded by TMA, when the query count changes).
// One CudaTreeAttention runs one launch at a time: concurrent run()s of the same object on
// different streams would share its counters.
//
// Short units (blocks of <= 16 rows with <= warp_unit_max_kv tokens, when a plan has at least
// warp_unit_min_units of them) run one per warp on a second kernel (tree_attention_warp.cuh),
// by default before the main kernel on `stream`. With warp_overlap it runs beside the main
// kernel instead: run() forks an internal non-blocking stream off `stream` with an event, launches
// the warp kernel there and the main kernel on `stream`, and joins with a second event before the
// merge (a graph captured on `stream` gets two parallel branches). The stream and events are
// created once, in the constructor.
//
// Kernel tile classes: a work item's q_count * g rows select 16-row (4 warps split the KV tile),
// 32-row or 64-row tiles; items with more than 64 rows run as several 64-row blocks. The KV tile
// is the kernel's own (64 tokens): the plan's tile_classes[].kv_tile only shapes its chunking.
#pragma once
#include <cstdint>
#include <memory>
#include <utility>

#include "core/attention_shape.h"
#include "core/kv_tree.h"
#include "cuda/backend.h"
#include "plan/plan.h"

struct CUstream_st;  // = cudaStream_t

namespace fasttree {

// Layout of the K and V pools run() reads.
enum class KvLayout {
  kSlotMajor,  // [S, Hkv, d]: a slot's KV heads side by side (the default)
  kHeadMajor,  // [Hkv, S, d]: each KV head's slots contiguous (a head's consecutive tokens are
               // consecutive rows); S = CudaTreeAttentionOptions::kv_slots
};

struct CudaTreeAttentionOptions {
  bool atomic_scheduler = true;  // CTAs pull units from an atomic counter; false: static round-robin
  int ctas_per_sm = 0;           // persistent CTAs per SM; 0 = as many as fit
  bool bulk_copy = false;        // ignored: the copy-engine row-gather variant was removed (slower
                                 // than cp.async on H200; src/cuda/PERF_NOTES.md)
  bool run_merge = true;         // false (diagnostics only): partial rows are not merged
  // Warp-per-unit path (tree_attention_warp.cuh): blocks of <= 16 rows whose chunk has at most this
  // many tokens run one unit per warp on a second kernel (beside the main one: warp_overlap). 0 = off;
  // < 0 = the FT_WARP_UNITS environment variable if set, else kDefaultWarpUnitMaxKv. head_dim 64 and
  // 128 only.
  int warp_unit_max_kv = -1;
  // The warp path is used for a plan only when it has at least this many eligible units (fewer
  // short units overlap the main kernel's long ones better than a second, serialized launch:
  // PERF_NOTES.md). < 0 = the FT_WARP_MIN_UNITS environment variable if set, else
  // kDefaultWarpUnitMinUnits.
  int warp_unit_min_units = -1;
  // 1: the warp kernel runs on an internal second stream beside the main kernel (fork/join events);
  // 0: serialized before the main kernel on the caller's stream; < 0: the FT_WARP_OVERLAP
  // environment variable if set, else 0. H200 paper suite (2026-12-01): serialized is 3-4 % faster
  // on the two suite cells that take the warp path beside long main-kernel units (deep GQA-1 trees
  // with 256-node levels: 218 -> 210 and 209 -> 203 us), 0.8 % slower on `1 4 16 64 256 1024`
  // 32/32 (1151 -> 1160 us); llama2-7b workload D end to end even (cuda/PERF_NOTES.md, session 15).
  int warp_overlap = -1;
  // Warp-kernel CTAs per SM (64 threads each); <= 0: the FT_WARP_CTAS environment variable if set,
  // else as many as fit alone (2 per SM measured far worse: geomean 6.50x floor vs 5.06x).
  int warp_ctas_per_sm = 0;
  // 1: the warp path runs the cp.async-staged kernel (tree_attention_warp_staged.cuh: each warp
  // streams its units through a private shared-memory ring, several 16-token jobs in flight);
  // 0: the register kernel (tree_attention_warp.cuh); < 0: the FT_WARP_STAGED environment variable
  // if set, else kDefaultWarpStaged.
  int warp_staged = -1;
  // Staged kernel shape: ring depth (2 or 3 jobs of 16 tokens per warp) and warps per CTA (1..4);
  // < 0: FT_WARP_STAGES / FT_WARP_CTA_WARPS if set, else the defaults below.
  int warp_stages = -1;
  int warp_cta_warps = -1;
  // 1: the merge kernel is launched as a programmatic dependent (PDL) of the tree kernel right
  // before it, so its CTAs are placed while the tree kernel drains (not with the warp kernel beside
  // the main one: there the merge waits on the join event); 0: a plain launch; < 0: the
  // FT_MERGE_PDL environment variable if set, else 1.
  int merge_pdl = -1;
  // Merge kernel variant: 1 = merge_kernel_wide (one CTA per (query, head) job, its rows split over
  // the CTA's lane groups), 0 = merge_kernel (a lane group per job); < 0: the FT_MERGE_WIDE
  // environment variable if set, else the one with the shorter chain of dependent round trips for
  // the plan's jobs and partial rows per job (cuda/merge_choice.h, prefer_wide_merge). Both run on
  // 8 CTAs per SM (the FT_MERGE_CTAS environment variable overrides it, A/B runs).
  int merge_wide = -1;
  // 1: K/V tiles that lie in one slot run, and the 16-row chunks of other tiles whose slots are
  // consecutive, are loaded by TMA (one copy per 64-column block instead of cp.async per 16
  // bytes); 0: cp.async only; < 0: the FT_TMA environment variable if
  // set, else 1. Falls back to cp.async where the pools cannot be described (tma_active()).
  int use_tma = -1;
  // 1: in the kernels that stage Q in shared memory (all but the 3-stage one), the Q rows of a
  // block of whole consecutive queries (row r = query q0 + r / g, g dividing 64) are loaded as one
  // TMA box per 64 columns instead of 16-byte cp.asyncs by the producer warp; other blocks keep
  // cp.async. 0: cp.async only; < 0: the FT_TMA_Q environment variable if set, else 1. Needs
  // use_tma. H200 paper suite, two calls: the 16/1 cells 0.7-1.6 % faster (`1 16 64` 16/1 16.2-16.3
  // -> 15.6-15.7 us), the others unchanged (cuda/PERF_NOTES.md, session 25).
  int use_tma_q = -1;
  // Tree kernel variant at head_dim 128: 1 = three K/V stages, Q fragments read from global memory
  // at each unit's first tile (no Q slots in shared memory); 0 = two stages with Q staged in
  // shared memory; < 0: the FT_DEEP_RING environment variable if set, else 1 below GQA
  // kDeepRingMaxGqa. The third stage pays on the bandwidth- and pipeline-bound cells (deep trees
  // at GQA 1 and 4: up to 9 % faster); at GQA 8 and 16 the units are fewer rows of more queries
  // and the Q load at each unit's start costs more (GQA 16: 2-7 % slower; GQA 8: up to 11 %
  // slower on small trees, within 2 % on large ones) (cuda/PERF_NOTES.md, session 11).
  int deep_ring = -1;
  // A plan of fewer main-kernel units than persistent CTAs launches one CTA per unit (at least one
  // per SM): with the full grid, unit i goes to CTA i, and the idle CTAs' start-up and the way the
  // hardware places CTAs two to an SM slowed the working ones (`1 2 64 / 8 256 32`, 128 units: 32/8
  // 17.6 -> 16.6 us, 32/32 27.2 -> 25.6; `1 10 / 4000 400` 16/1, 136 units: 16.8 -> 15.1;
  // cuda/PERF_NOTES.md session 17). < 0: the FT_FIT_GRID environment variable if set, else on;
  // ignored when ctas_per_sm is set.
  int fit_grid = -1;
  KvLayout kv_layout = KvLayout::kSlotMajor;
  // Slots per KV pool (S): required by the head-major layout; optional for slot-major, where it
  // bounds the TMA tensor (0: unbounded).
  int64_t kv_slots = 0;
  // Diagnostics: device buffer of kTraceKinds x kTraceCtas x kTraceEvents uint64 (device_plan.h)
  // that FT_TRACE builds of the kernels fill with per-CTA timeline marks; nullptr = none.
  unsigned long long* trace = nullptr;  // S of the head-major layout (> 0 required there; upload() checks slots < S)
};
inline constexpr int kDefaultWarpUnitMaxKv = 128;
inline constexpr int kDefaultWarpStaged = 1;
inline constexpr int kDefaultWarpStages = 2;
inline constexpr int kDefaultWarpCtaWarps = 3;
// Overlapped and serialized alike: with the overlap, thresholds 0 and 4096 measured the same
// within noise (geomean 5.08 vs 5.06x floor; 0 was ~0.5 us slower on three 26-30 us cells).
inline constexpr int kDefaultWarpUnitMinUnits = 4096;
// CudaTreeAttentionOptions::deep_ring's default: the 3-stage kernel below this GQA ratio.
inline constexpr int kDeepRingMaxGqa = 8;

class CudaTreeAttention {
 public:
  // sm_scale <= 0 selects 1/sqrt(head_dim). Throws when the shape has no kernel (head_dim not 64,
  // 128 or 256) or no CUDA device is usable.
  CudaTreeAttention(const AttnShape& shape, KvDType dtype, float sm_scale = 0.0f,
                    CudaTreeAttentionOptions options = {});
  ~CudaTreeAttention();
  CudaTreeAttention(const CudaTreeAttention&) = delete;
  CudaTreeAttention& operator=(const CudaTreeAttention&) = delete;

  // Checks the plan's indices against the tree and the shape (everything the kernels dereference;
  // the plan's semantics are plan_validate's job), then uploads it. num_slots >= 0 also checks
  // every tree slot against the KV pool size. O(items + segments + queries + tokens).
  void upload(const Plan& plan, const KvTree& tree, CUstream_st* stream = nullptr, int64_t num_slots = -1);

  // Enqueues the uploaded plan's attention on `stream` (see the header comment).
  void run(const void* q, const void* k, const void* v, float* out, float* lse, CUstream_st* stream = nullptr) const;

  // Fills the partial-result workspace with NaN (tests: proves every merged row was written).
  void poison_workspace(CUstream_st* stream = nullptr) const;

  uint64_t graph_epoch() const;
  const AttnShape& shape() const;
  KvDType dtype() const;
  float sm_scale() const;
  int num_queries() const;  // of the uploaded plan
  int num_units() const;    // (block, kv head) units of the uploaded plan
  int grid_size() const;    // persistent CTAs of the main kernel's launch for the uploaded plan
  bool warp_overlap() const;  // the warp kernel runs on the side stream (resolved option)
  // Whether the last run() loaded K/V tiles by TMA where it could (FT_TMA != 0 and the pools'
  // descriptors encoded); false before the first run().
  bool tma_active() const;
  // Whether the last run() had Q maps for the blocks of whole consecutive queries (use_tma_q, the
  // kernel staging Q in shared memory, the maps encoded); false before the first run().
  bool tma_q_active() const;
  // Diagnostics: the device plan arena's bytes in use (what run() reads of the plan).
  std::pair<const void*, size_t> plan_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fasttree
