// Scheduler: request queue, continuous batching, radix prefix cache, FastTree decode (DESIGN.md §7),
// over any DecoderModel (engine/model.h: CpuModel now, the GPU model later).
//
// Requests are admitted first come, first served. Admitting one (between decode steps):
//   1. match its prompt (all but the last token, whose logits are needed) in the RadixCache and
//      lock the match;
//   2. check that its KV slots fit: uncached prompt tokens + n * (max_new_tokens - 1) must be at
//      most free + evictable slots; if not, unlock and wait (the head of the queue blocks the rest)
//      until running sequences finish. A request's worst case is allocated up front (each sample's
//      generated tokens get one run of consecutive slots, which the attention kernels read as one
//      piece instead of one slot per step), so a running sequence never lacks a slot: nothing is
//      preempted and nothing crashes;
//   3. evict (LRU, unlocked leaves first) as needed, allocate slots for the uncached tokens, insert
//      the prompt into the cache and lock its node once per sample (its K/V is computed below, in
//      this same step, before anything reads it), and join the pending prefill batch;
//   4. batched prefill: the pending requests' uncached tokens go to the model in ONE prefill_batch
//      call (in admission order, so a request may attend to a prefix that an earlier request of the
//      batch computes) once the batch holds max_prefill_tokens tokens, and when admission stops;
//   5. fork each into n sequences that share the prompt's cache nodes, each sampling its first
//      token from the prompt's last logits with its own Sampler (sample i: seed + i).
// A decode step feeds every running sequence's last token: one new slot each, appended to the
// sequence's private tail. When the set of running sequences is the one of the previous step, the
// previous KvTree grows by one token per leaf and the previous plan is patched (engine/plan_extend.h);
// otherwise (a sequence joined or finished) the tree is rebuilt from the cache (core/cache_tree.h
// build_kv_tree: shared prompt nodes + one tail leaf per sequence; or one whole-path root per
// sequence in the per-request baseline) and re-planned. A sequence finishes after max_new_tokens
// tokens or after emitting a stop token; its fed tokens (prompt + generated, all but the last) are
// inserted into the cache (when cache_generated), its locks dropped and its unused reservation
// released. A request's result is complete when its n samples are.
//
// submit() rejects, with a one-line fasttree::Error, what can never run: an empty prompt, a token
// outside the vocabulary, max_new_tokens < 0, n < 1 or n > max_running, bad sampling parameters, a
// context beyond a sliding window, and a request needing more KV slots than the whole pool
// (prompt + n * (max_new_tokens - 1) > capacity). max_new_tokens == 0 finishes at once, empty.
// Single-threaded; an exception from the model leaves the scheduler unusable.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/kv_tree.h"
#include "core/radix_cache.h"
#include "core/slot_pool.h"
#include "engine/model.h"
#include "engine/plan_extend.h"
#include "engine/sampler.h"
#include "engine/slot_paths.h"
#include "plan/plan.h"
#include "plan/planner.h"

namespace fasttree {

struct GenerationRequest {
  std::vector<int32_t> prompt;       // token ids, non-empty
  int max_new_tokens = 16;           // tokens generated per sample (fewer when a stop token comes)
  int n = 1;                         // samples sharing the prompt
  SamplingParams sampling;           // sample i draws with seed sampling.seed + i
  std::vector<int32_t> stop_tokens;  // a sample stops after emitting one (it is kept in the output)
};

struct GenerationResult {
  int64_t id = -1;                             // submit() order, from 0
  std::vector<std::vector<int32_t>> samples;   // [n] generated tokens
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;                   // prompt tokens reused from the prefix cache
};

// What SchedulerOptions::on_token_logits sees: the logits a sample's next token is chosen from.
struct TokenLogits {
  int64_t request_id = -1;         // submit() order
  int sample = 0;                  // sample index within the request
  int64_t index = 0;               // index of the token about to be chosen in the sample's output
  std::span<const float> logits;   // [vocab]; valid during the call only
};

struct SchedulerOptions {
  int max_running = 256;                                // sequences decoded together at most
  DecodeAttention attention = DecodeAttention::kFastTree;
  PathSharing sharing = PathSharing::kShared;           // kPerRequest: per-request attention baseline
  PlannerConfig planner = engine_planner_config();
  bool cache_generated = true;  // finished sequences' tokens stay in the prefix cache
  // A batched prefill is sent to the model once the pending admissions hold at least this many
  // uncached tokens (and whenever admission stops). 1: one request per prefill call.
  int64_t max_prefill_tokens = 8192;
  bool extend_plans = true;     // false: rebuild the tree and re-plan every decode step
  // Optional observer of the logits behind every generated token (the prefill's last row for a
  // sample's first token, its decode row for the others), called before the token is chosen. When
  // set, decode steps always take logits (model.decode) instead of the model's greedy path. For
  // tolerance checks (`fasttree bench-e2e --check-steps`); leave empty when measuring speed.
  std::function<void(const TokenLogits&)> on_token_logits;
};

struct SchedulerStats {
  int64_t requests_submitted = 0;
  int64_t requests_finished = 0;
  int64_t prompt_tokens = 0;         // Σ prompt lengths of admitted requests
  int64_t cached_prompt_tokens = 0;  // of those, reused from the cache
  int64_t prefill_tokens = 0;        // tokens computed by prefill
  int64_t prefill_calls = 0;         // model prefill_batch calls (each may hold several requests)
  int64_t decode_steps = 0;
  int64_t decode_tokens = 0;         // Σ batch sizes of the decode steps
  int64_t generated_tokens = 0;
  int64_t plans = 0;                 // planner runs (FastTree attention)
  int64_t plan_extensions = 0;       // decode steps that patched the previous plan instead
  int64_t tree_rebuilds = 0;         // decode steps that rebuilt the KvTree (batch changed)
  int64_t evicted_tokens = 0;
  int64_t admission_waits = 0;       // steps where the head of the queue waited for KV slots
  int max_batch = 0;                 // largest decode batch
  double plan_ms = 0;                // host time building decode trees and planning / extending plans
  double decode_ms = 0;              // host time in the model's decode calls (includes the device work)
  double prefill_ms = 0;             // host time in the model's prefill calls
  double cache_hit_rate() const {
    return prompt_tokens > 0 ? static_cast<double>(cached_prompt_tokens) / static_cast<double>(prompt_tokens) : 0.0;
  }
};

class Scheduler {
 public:
  // The model must outlive the scheduler; its whole KV pool (num_slots()) is managed here.
  explicit Scheduler(DecoderModel& model, SchedulerOptions options = {});
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Validates and queues a request (see above); returns its id.
  int64_t submit(GenerationRequest request);
  // Admits what fits, then runs one decode step over the running sequences. False when idle.
  bool step();
  // Steps until idle; returns the results finished since the last take_finished(), by id.
  std::vector<GenerationResult> run();
  // Results finished since the last call, in finishing order.
  std::vector<GenerationResult> take_finished();

  bool idle() const { return waiting_.empty() && running_.empty(); }
  size_t num_waiting() const { return waiting_.size(); }   // requests
  size_t num_running() const { return running_.size(); }   // sequences
  const SchedulerStats& stats() const { return stats_; }
  const RadixCache& cache() const { return cache_; }
  const SlotPool& pool() const { return pool_; }
  const KvTree& last_tree() const { return tree_; }  // tree of the last decode step
  const Plan& last_plan() const { return plan_; }    // its plan (FastTree attention)
  int64_t reserved_slots() const { return reserved_; }  // allocated for generated tokens, not fed yet
  // Throws fasttree::Error when the cache or the slot accounting is inconsistent (tests).
  void check_invariants() const;

 private:
  struct Group {
    int64_t id = -1;
    GenerationRequest request;
    GenerationResult result;
    int unfinished = 0;
  };
  struct Sequence {
    Group* group = nullptr;
    int sample = 0;
    NodeId node = kRootNode;           // locked cache node: the prompt
    int64_t prompt_len = 0;
    std::vector<int32_t> tail_slots;   // KV slots of the generated tokens fed so far
    std::vector<int32_t> tail_alloc;   // slots allocated for its generated tokens (ascending run)
    int64_t reserve_left = 0;          // of those, not fed yet: tail_alloc's last reserve_left
    std::unique_ptr<Sampler> sampler;
  };

  // An admitted request waiting for the batched prefill (step 4 above).
  struct PendingPrefill {
    Group* group = nullptr;
    NodeId node = kRootNode;             // the prompt's cache node, locked once per sample
    int64_t offset = 0;                  // prompt tokens reused from the cache
    std::vector<int32_t> positions, new_slots, context_slots;
    std::vector<std::vector<int32_t>> tails;  // [n] each sample's generated-token slots
  };

  bool admit(Group& group);          // false: does not fit now
  void flush_prefill();              // runs the pending batch (no-op when empty)
  void start_group(PendingPrefill& p, std::span<const float> logits);
  void ensure_free(int64_t n);
  void decode_step();
  void sample_into(Sequence& seq, std::span<const float> logits);
  bool is_done(const Sequence& seq) const;
  void finish(Sequence& seq);
  void finish_group_if_done(Group& group);
  std::vector<int32_t> path_slots(NodeId node) const;

  DecoderModel& model_;
  SchedulerOptions options_;
  SlotPool pool_;
  RadixCache cache_;
  Planner planner_;
  std::deque<std::unique_ptr<Group>> waiting_;
  std::vector<std::unique_ptr<Group>> active_;       // admitted, not finished
  std::vector<std::unique_ptr<Sequence>> running_;   // in batch order
  std::vector<GenerationResult> finished_;
  int64_t next_id_ = 0;
  int64_t reserved_ = 0;     // Σ reserve_left of running sequences (allocated, not fed yet)
  std::vector<PendingPrefill> pending_;
  int64_t pending_tokens_ = 0;    // Σ uncached tokens of pending_
  int64_t pending_seqs_ = 0;      // Σ samples of pending_
  std::vector<int32_t> deferred_free_;  // duplicate slots freed once the pending batch has run
  bool batch_changed_ = true;
  KvTree tree_;
  Plan plan_;
  PlanExtendScratch extend_scratch_;  // grow_query_leaves / extend_plan workspace between steps
  SchedulerStats stats_;
  // Per-step buffers.
  std::vector<int32_t> step_tokens_, step_positions_, step_slots_;
};

}  // namespace fasttree
