// Host-side entry points of the CUDA layer. Includes no CUDA header, so apps and tests can call
// it whether or not the CUDA backend was built (without nvcc these report "not built").
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/attention_shape.h"
#include "core/kv_tree.h"
#include "plan/plan.h"

namespace fasttree {

enum class KvDType { kF16, kBF16 };

// True when this binary contains the CUDA backend (built with nvcc).
bool cuda_backend_built();
// Number of usable CUDA devices; 0 when none is present or the backend was not built.
int cuda_device_count();
// Makes `device` current on the calling thread (cudaSetDevice); throws fasttree::Error naming the
// device and the count when it is missing, or when the backend was not built.
void cuda_set_device(int device);

// Runs the plan on the GPU. Inputs are host fp32 arrays converted to `dtype` for the device;
// shapes as in core/attention_shape.h (out fp32 [Q, Hq, d], lse fp32 [Q, Hq] or empty). Throws
// fasttree::Error when the backend is not available. Allocates device memory for this call: an
// engine keeps a CudaTreeAttention (cuda/tree_attention.h) and device tensors instead.
// [a, b, d] -> [b, a, d] (16-bit elements): between slot-major [S, Hkv, d] and head-major
// [Hkv, S, d] K/V pools (KvLayout). Host only.
std::vector<uint16_t> swap_outer_dims(const std::vector<uint16_t>& x, int64_t a, int64_t b, int64_t d);

void cuda_attention(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype,
                    std::span<const float> q, std::span<const float> k, std::span<const float> v,
                    float sm_scale, std::span<float> out, std::span<float> lse);

// Knobs of the host-array entry points, for tests and tools.
struct CudaRunOptions {
  bool poison_outputs = false;   // fill device out/lse and the partial workspace with NaN before each repeat
  bool use_graph = false;        // capture the launch sequence in a CUDA graph and replay it
  int repeats = 1;               // run (or replay) this many times; the last result is returned
  bool atomic_scheduler = true;  // false: persistent CTAs take units round-robin
  bool bulk_copy = false;        // ignored (the bulk-copy kernel variant was removed)
  int warp_unit_max_kv = -1;     // CudaTreeAttentionOptions::warp_unit_max_kv
  int warp_unit_min_units = -1;  // CudaTreeAttentionOptions::warp_unit_min_units
  int warp_overlap = -1;         // CudaTreeAttentionOptions::warp_overlap
  int warp_staged = -1;          // CudaTreeAttentionOptions::warp_staged
  int warp_stages = -1;          // CudaTreeAttentionOptions::warp_stages
  int warp_cta_warps = -1;       // CudaTreeAttentionOptions::warp_cta_warps
  int merge_wide = -1;           // CudaTreeAttentionOptions::merge_wide
  bool kv_head_major = false;    // k / v are uploaded as [Hkv, S, d] (KvLayout::kHeadMajor)
  int use_tma = -1;              // CudaTreeAttentionOptions::use_tma
  bool require_tma = false;      // throw unless the run loaded its full tiles by TMA (tma_active())
  int use_tma_q = -1;            // CudaTreeAttentionOptions::use_tma_q
  bool require_tma_q = false;    // throw unless the run's Q maps were in use (tma_q_active())
  int deep_ring = -1;            // CudaTreeAttentionOptions::deep_ring
  int fit_grid = -1;             // CudaTreeAttentionOptions::fit_grid
};

void cuda_attention(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype,
                    std::span<const float> q, std::span<const float> k, std::span<const float> v,
                    float sm_scale, std::span<float> out, std::span<float> lse, const CudaRunOptions& options);

// Per-request baseline (plan/per_request_plan.h): every query reads its whole path, no sharing.
void cuda_attention_per_request(const KvTree& tree, const AttnShape& shape, KvDType dtype,
                                std::span<const float> q, std::span<const float> k, std::span<const float> v,
                                float sm_scale, std::span<float> out, std::span<float> lse,
                                const CudaRunOptions& options = {});

// Timing of one attention call on device-resident random inputs (CUDA events, median of `iters`
// runs after `warmup` untimed ones). What the L2 cache holds when each timed run starts:
enum class L2Mode {
  // Rotated inputs (the default): as many copies of the inputs (Q, K/V pools, the uploaded plan,
  // outputs) as it takes for each copy to be re-read only after 4x the L2 capacity of the others'
  // bytes; no flush. Every input is cold, as in an engine where each layer reads its own K/V; the
  // kernels' code and parameters stay cached, and the L2 holds clean lines (plus the other copies'
  // few dirty output rows).
  kRotate,
  // A read of a 256 MB buffer before every run: inputs and code cold, L2 clean.
  kCleanFlush,
  // A 256 MB memset before every run (the harness up to the twenty-sixth session): inputs and code
  // cold, and the L2 full of dirty lines whose write-back the timed run pays (~50 MB: 5-12 % of
  // the bandwidth-bound cells' time on the H200).
  kDirtyFlush,
  // Nothing flushed (diagnostics): inputs stay cached from the previous run where they fit.
  kWarm,
};
// "rotate", "clean", "dirty", "warm"; throws on anything else.
L2Mode parse_l2_mode(const std::string& name);
const char* l2_mode_name(L2Mode mode);

struct CudaTiming {
  double median_us = 0;
  double min_us = 0;
  int runs = 0;
  int copies = 1;  // copies of the inputs the runs rotated through (L2Mode::kRotate), else 1
  // With CudaTimingOptions::trace in an FT_TRACE build: the marks of one more run (same L2 mode),
  // [kind][cta][event] as in cuda/device_plan.h (kTraceKinds x kTraceCtas x kTraceEvents ns
  // stamps, 0 = not reached).
  std::vector<uint64_t> trace;
};
struct CudaTimingOptions {
  int warmup = 10;
  int iters = 50;
  L2Mode l2 = L2Mode::kRotate;
  bool use_graph = false;        // time graph replays instead of plain launches
  bool atomic_scheduler = true;
  bool bulk_copy = false;        // ignored (the bulk-copy kernel variant was removed)
  bool skip_merge = false;       // diagnostics: time the tree kernel without merging partial rows
  int warp_unit_max_kv = -1;     // CudaTreeAttentionOptions::warp_unit_max_kv
  int warp_unit_min_units = -1;  // CudaTreeAttentionOptions::warp_unit_min_units
  int warp_overlap = -1;         // CudaTreeAttentionOptions::warp_overlap
  int warp_staged = -1;          // CudaTreeAttentionOptions::warp_staged
  int warp_stages = -1;          // CudaTreeAttentionOptions::warp_stages
  int warp_cta_warps = -1;       // CudaTreeAttentionOptions::warp_cta_warps
  int gpu_warmup_ms = 20;        // keep the GPU busy this long first (clocks up); the first call 300 ms
  bool kv_head_major = false;    // K/V pools laid out [Hkv, S, d] (KvLayout::kHeadMajor)
  int use_tma = -1;              // CudaTreeAttentionOptions::use_tma
  int deep_ring = -1;            // CudaTreeAttentionOptions::deep_ring
  bool trace = false;            // also record one run's per-CTA timeline (FT_TRACE builds only)
};
// True when the kernels of this binary were built with their timeline marks (-DFASTTREE_TRACE=ON).
bool cuda_trace_built();
CudaTiming cuda_time_plan(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype,
                          const CudaTimingOptions& options = {});
// The same harness (L2 mode, events, graph or plain launch) around one empty kernel of `grid` CTAs:
// what a launch costs in these timings before any work (kRotate has nothing to rotate: no flush).
CudaTiming cuda_time_empty_launch(int grid, const CudaTimingOptions& options = {});

}  // namespace fasttree
