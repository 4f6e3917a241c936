// Measured end-to-end runs for `fasttree bench-e2e`: a workload (engine/workloads.h) through the
// engine's Scheduler, stepped one decode step at a time, and the greedy-agreement check of FastTree
// vs per-request attention.
//
// run_e2e submits every request, then calls Scheduler::step() until idle, timing each call on the
// host. Per decode step it records:
//   * step time = wall time of step() minus the prefill time spent in it (admissions);
//   * planner time (SchedulerStats::plan_ms delta), batch size;
//   * unique KV tokens of the step's tree (distinct slots of Scheduler::last_tree(), recounted when
//     the tree was rebuilt, + batch otherwise) and from it the step's floor on one H200:
//     (weight bytes + unique KV bytes) / 4.31 TB/s, with weight bytes = num_params · 2 (bf16) and
//     KV bytes per token = layers · 2 · Hkv · head_dim · 2;
//   * every `profile_every`-th decode step (0 = never) with model profiling on: the model's
//     attention / GEMM / other device times (DecoderModel::decode_times deltas; the CPU model has none).
// Throughput = generated tokens / (Σ wall time of all step() calls: prefill + decode).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/model.h"
#include "engine/scheduler.h"

namespace fasttree {

struct E2eRunOptions {
  SchedulerOptions scheduler;
  int profile_every = 8;       // profile one decode step in this many (0 = none)
  bool progress = false;       // progress bar on stderr
  std::string label;           // progress bar label
};

struct E2eMeasurement {
  int64_t requests = 0, sequences = 0, generated_tokens = 0;
  double seconds = 0;           // Σ step() wall time
  double tokens_per_s = 0;
  int64_t decode_steps = 0;
  double mean_batch = 0;
  int max_batch = 0;
  double decode_step_ms = 0;    // mean step time without prefill
  int64_t profiled_steps = 0;   // decode steps with device timings
  double attention_ms = 0, gemm_ms = 0, other_ms = 0;  // mean per profiled step
  double comm_ms = 0;           // tensor-parallel all-reduces (DecodeTimes::comm_ms), mean per profiled step
  double plan_ms_per_step = 0;
  double prefill_s = 0;
  int64_t prefill_tokens = 0;
  double cache_hit_rate = 0;
  double mean_unique_kv_tokens = 0;
  double floor_step_ms = 0;     // mean over decode steps
  double rest_ms() const { return profiled_steps > 0 ? decode_step_ms - attention_ms - gemm_ms : 0.0; }
  double plan_share() const { return decode_step_ms > 0 ? plan_ms_per_step / decode_step_ms : 0.0; }
  double step_vs_floor() const { return floor_step_ms > 0 ? decode_step_ms / floor_step_ms : 0.0; }
};

// Bytes a decode step must read at least, per KV token and for the weights (bf16).
double weight_bytes_bf16(const ModelConfig& config);
double kv_bytes_per_token_bf16(const ModelConfig& config);

// Runs `requests` to completion on a fresh Scheduler over `model` (whose KV pool it takes over).
E2eMeasurement run_e2e(DecoderModel& model, const std::vector<GenerationRequest>& requests, const E2eRunOptions& options);

// Greedy agreement of FastTree (sharing kShared) vs per-request (kPerRequest) attention: both runs
// take logits every step (SchedulerOptions::on_token_logits) and compare each sample's tokens. A
// sample whose tokens first differ at index i counts as a tie when, in the FastTree run's logits at
// i, logit[its token] - logit[the per-request token] <= tie_tol · max(1, |top logit|).
struct Divergence {
  int64_t request = 0;
  int sample = 0;
  int64_t index = 0;             // first differing token (0 = first generated token)
  int32_t fasttree_token = 0, per_request_token = 0;
  double gap = 0;                // fasttree logits: logit[fasttree token] - logit[per-request token]
  double tolerance = 0;          // tie_tol · max(1, |top logit|)
  bool tie() const { return gap <= tolerance; }
};

struct AgreementCheck {
  int64_t sequences = 0;
  int64_t tokens_per_sequence = 0;
  int64_t agree = 0;             // every token equal
  int64_t ties = 0;              // diverged, within the tie tolerance
  int64_t mismatches = 0;        // diverged beyond it
  double tie_tol = 0;
  double min_fasttree_margin = 0;  // smallest top-2 logit margin seen in the FastTree run
  std::vector<Divergence> divergences;  // request order
};

// `requests` should already carry the number of tokens to compare as max_new_tokens.
AgreementCheck check_greedy_agreement(DecoderModel& model, const std::vector<GenerationRequest>& requests,
                                      const SchedulerOptions& base, double tie_tol);

}  // namespace fasttree
