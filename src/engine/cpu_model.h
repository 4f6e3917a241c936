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
//   planner (planned once per call, executed per layer by cpu/executor), or, as the independent
//   check, through cpu/reference on the same tree.
// Every bad input (token out of vocab, slot out of range or used twice, size mismatch, a query's
// path not ending at its slot, a context beyond the sliding window) throws fasttree::Error.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/kv_tree.h"
#include "cpu/executor.h"
#include "engine/rope.h"
#include "engine/weights.h"
#include "plan/plan.h"
#include "plan/planner.h"

namespace fasttree {

enum class DecodeAttention {
  kFastTree,   // Planner + execute_plan (cpu/executor)
  kReference,  // reference_attention (cpu/reference, fp64)
};

struct DecodeBatch {
  std::span<const int32_t> tokens;     // [B] input token of each request
  std::span<const int32_t> positions;  // [B] its position (RoPE)
  std::span<const int32_t> slots;      // [B] KV slot its K/V is written to (distinct)
  const KvTree* tree = nullptr;        // B queries; query b's path ends with slots[b]
};

// Largest KV pool (K and V of every layer, fp32) a CpuModel allocates.
inline constexpr double kMaxCpuKvBytes = 32.0 * (1 << 30);

struct CpuModelOptions {
  int num_threads = 0;     // 0 = all hardware threads
  PlannerConfig planner;   // decode planning (FastTree attention)
};

class CpuModel {
 public:
  CpuModel(ModelWeights weights, int32_t num_slots, CpuModelOptions options = {});

  const ModelConfig& config() const { return weights_.config; }
  const ModelWeights& weights() const { return weights_; }
  int32_t num_slots() const { return num_slots_; }
  Planner& planner() { return planner_; }
  const Plan& last_plan() const { return plan_; }  // plan of the last FastTree decode

  // Returns logits [1, V] of the last new token, or [n, V] of every new token when all_logits.
  std::vector<float> prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                             std::span<const int32_t> slots, std::span<const int32_t> context_slots,
                             bool all_logits = false);
  // Returns logits [B, V].
  std::vector<float> decode(const DecodeBatch& batch, DecodeAttention attention = DecodeAttention::kFastTree);

  // Layer `layer`'s K or V pool, [num_slots, Hkv, d].
  std::span<const float> k_cache(int layer) const;
  std::span<const float> v_cache(int layer) const;

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
};

}  // namespace fasttree
