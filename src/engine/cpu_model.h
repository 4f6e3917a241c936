// CpuModel: fp32 forward pass of a Llama-family decoder on the CPU (the engine's CI path and the
// semantic reference of the GPU path), over a KV pool of `num_slots` token slots per layer:
//   K_l, V_l [num_slots, Hkv, d]   (DESIGN.md §2; slots are handed out by core/slot_pool)
//
// Per layer, for token rows x [n, h]: RMSNorm -> q/k/v projections (+ biases when the config has
// them) -> RoPE at each row's position -> K/V rows written to their slots -> attention -> o_proj,
// residual -> RMSNorm -> SwiGLU MLP, residual. Then the final RMSNorm and lm_head (or the tied
// embedding) -> logits. GQA: qo head h reads kv head h / (Hq / Hkv); sm_scale = 1/sqrt(d).
//
// prefill: new tokens [n] at `positions`, K/V written to `slots` [n]; token i attends causally to
//   the cached prefix `context_slots` (already in the pool) followed by new tokens 0..i. Attention
//   runs through cpu/reference (fp64) over a chain KvTree: root = context, then one node per token.
//   The causal mask follows the order of the slots; positions only feed RoPE (normally
//   positions[i] = context_slots.size() + i).
// decode: one new token per request; `tree` has one query per request whose root -> node path is
//   the request's whole context, ending with the request's own new slot (built with
//   core/cache_tree.h build_kv_tree or engine/slot_paths.h). Attention goes through the FastTree
//   planner (planned once per call unless the batch brings its plan, executed per layer by
//   cpu/executor), or, as the independent check, through cpu/reference on the same tree.
// Every bad input (token out of vocab, slot out of range or used twice, size mismatch, a query's
// path not ending at its slot, a context beyond the sliding window) throws fasttree::Error.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "core/kv_tree.h"
#include "cpu/executor.h"
#include "engine/model.h"
#include "engine/rope.h"
#include "engine/weights.h"
#include "plan/plan.h"
#include "plan/planner.h"

namespace fasttree {

// Largest KV pool (K and V of every layer, fp32) a CpuModel allocates.
inline constexpr double kMaxCpuKvBytes = 32.0 * (1 << 30);

struct CpuModelOptions {
  int num_threads = 0;     // 0 = all hardware threads
  PlannerConfig planner = engine_planner_config();   // decode planning (FastTree attention)
};

class CpuModel final : public DecoderModel {
 public:
  CpuModel(ModelWeights weights, int32_t num_slots, CpuModelOptions options = {});

  const ModelConfig& config() const override { return weights_.config; }
  const ModelWeights& weights() const { return weights_; }
  int32_t num_slots() const override { return num_slots_; }
  Planner& planner() { return planner_; }
  const Plan& last_plan() const { return plan_; }  // plan of the last FastTree decode that planned here

  // Returns logits [1, V] of the last new token, or [n, V] of every new token when all_logits.
  std::vector<float> prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                             std::span<const int32_t> slots, std::span<const int32_t> context_slots,
                             bool all_logits = false) override;
  // Returns logits [B, V]. With batch.plan set (FastTree) that plan is executed instead of planning
  // here; it is validated against the tree (validate_plan) first.
  std::vector<float> decode(const DecodeBatch& batch, DecodeAttention attention = DecodeAttention::kFastTree) override;

  // Layer `layer`'s K or V pool, [num_slots, Hkv, d].
  std::span<const float> k_cache(int layer) const;
  std::span<const float> v_cache(int layer) const;

  // Called with the output y [n, h] of every row-parallel GEMM (each layer's o_proj, then its
  // down_proj) before the residual add; it may change y in place. Tensor parallelism
  // (engine/tp_cpu_model.h) runs one CpuModel per rank on its weight shard and all-reduces the
  // ranks' partial sums here. Empty (the default): the unsharded model.
  using RowParallelHook = std::function<void(std::span<float> y)>;
  void set_row_parallel_hook(RowParallelHook hook) { row_parallel_hook_ = std::move(hook); }

 private:
  // Attention of one layer: q [n, Hq, d] -> out [n, Hq, d], with K/V of the layer's pool.
  using AttendFn = std::function<void(int layer, std::span<const float> q, std::span<float> out)>;
  // Logits of rows [first_logit_row, n).
  std::vector<float> forward(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                             std::span<const int32_t> slots, const AttendFn& attend, int64_t first_logit_row);
  void check_tokens(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                    std::span<const int32_t> slots, const char* what) const;

  ModelWeights weights_;
  int32_t num_slots_;
  CpuModelOptions options_;
  Rope rope_;
  std::vector<std::vector<float>> k_, v_;  // per layer [num_slots, Hkv, d]
  Planner planner_;
  Plan plan_;
  CpuWorkspace workspace_;
  RowParallelHook row_parallel_hook_;
};

}  // namespace fasttree
