// TpCpuModel: tensor-parallel CPU model (issue 5's CPU part): tp ranks, one thread per rank, each a
// CpuModel over its weight shard (engine/tp_shard.h) and its own KV pool shard
//   K_l, V_l [num_slots, Hkv_local, d] per rank   (Hkv_local = Hkv / tp, or 1 replicated head)
// whose partial outputs of o_proj and down_proj are all-reduced (engine/all_reduce.h LocalGroup,
// the CPU stand-in for NCCL) before each residual add. Embedding, norms and lm_head are
// replicated: every rank computes the same logits (checked bitwise) and rank 0's are returned.
//
// The scheduler, radix cache and planner run once, outside the ranks: config() is the whole
// model's, slots are shared (every rank writes token t's K/V for its heads to the same slot), and
// a decode plans once per call (or takes the batch's plan) and every rank executes that one plan
// with its local head counts. A plan is head-agnostic apart from the head counts it records and
// the GQA ratio g its tiles were sized for: a plan built for the whole model's shape (what the
// scheduler does) is copied once per decode call into a rank-local header (heads = the local
// ones; local g <= g, so its tiles stay within their class). Planning cost does not grow with tp.
//
// Failures: a rank that throws aborts the group, so every other rank leaves its collective at once
// with an Error; a rank that does not arrive within options.collective_timeout makes the waiting
// ranks abort. The call then throws one Error naming the first failing rank and its reason;
// last_rank_errors() holds every rank's message. The group is reset after all rank threads have
// joined, so the model stays usable (KV slots written by the failed call hold garbage until they
// are written again, as with CpuModel). A rank stuck forever outside the collectives cannot be
// interrupted on the CPU (the GPU path's watchdog aborts the communicator instead).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/all_reduce.h"
#include "engine/cpu_model.h"
#include "engine/model.h"
#include "engine/tp_shard.h"
#include "engine/weights.h"
#include "plan/plan.h"
#include "plan/planner.h"

namespace fasttree {

struct TpCpuModelOptions {
  int tp = 1;                  // ranks; the heads and intermediate size must split (check_tp)
  int threads_per_rank = 0;    // 0 = hardware threads / tp (at least 1)
  PlannerConfig planner = engine_planner_config();       // decode planning when the batch brings no plan
  std::chrono::milliseconds collective_timeout = LocalGroup::kDefaultTimeout;
  // Called on rank `rank`'s thread before each of its all-reduces, with the index of that
  // all-reduce within the current prefill/decode call (0, 1, ...: 2 per layer). It may throw:
  // tests inject a failing or slow rank through it.
  std::function<void(int rank, int64_t index)> before_all_reduce;
};

class TpCpuModel final : public DecoderModel {
 public:
  // Shards `weights` (the whole model) over options.tp ranks; throws when they do not split.
  TpCpuModel(const ModelWeights& weights, int32_t num_slots, TpCpuModelOptions options = {});
  ~TpCpuModel() override;
  // The ranks' all-reduce hooks point at this object: neither copyable nor movable.
  TpCpuModel(const TpCpuModel&) = delete;
  TpCpuModel& operator=(const TpCpuModel&) = delete;

  const ModelConfig& config() const override { return config_; }  // the whole model's
  int32_t num_slots() const override { return num_slots_; }
  int tp() const { return static_cast<int>(ranks_.size()); }
  const TpShard& shard(int rank) const;
  const CpuModel& rank_model(int rank) const;  // its local config, weights and KV pool shard
  Planner& planner() { return planner_; }
  const Plan& last_plan() const { return plan_; }  // rank-local plan of the last FastTree decode

  std::vector<float> prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                             std::span<const int32_t> slots, std::span<const int32_t> context_slots,
                             bool all_logits = false) override;
  // batch.plan, when set, must have been built for this model's whole shape (config().attn_shape())
  // or for the rank-local shape.
  std::vector<float> decode(const DecodeBatch& batch, DecodeAttention attention = DecodeAttention::kFastTree) override;

  // Every rank's error message of the last failed call, by rank ("" for a rank that finished).
  const std::vector<std::string>& last_rank_errors() const { return rank_errors_; }

 private:
  // Runs fn(rank) on one thread per rank (rank 0 on the caller's) and returns rank 0's logits.
  std::vector<float> run_ranks(const std::function<std::vector<float>(int rank)>& fn);

  ModelConfig config_;
  int32_t num_slots_;
  TpCpuModelOptions options_;
  std::vector<TpShard> shards_;
  std::vector<std::unique_ptr<CpuModel>> ranks_;
  std::unique_ptr<LocalGroup> group_;
  std::vector<int64_t> reduce_index_;  // [tp] all-reduces of each rank in the current call
  Planner planner_;
  Plan plan_;
  std::vector<std::string> rank_errors_;
};

}  // namespace fasttree
