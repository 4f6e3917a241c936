#include "apps/e2e_run.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "apps/progress_bar.h"
#include "core/error.h"
#include "engine/sampler.h"
#include "plan/plan_stats.h"

namespace fasttree {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

// Distinct KV slots of a tree (the per-request tree repeats shared slots on every path).
class DistinctSlots {
 public:
  explicit DistinctSlots(int64_t num_slots) : stamp_(static_cast<size_t>(num_slots), 0) {}
  int64_t count(const KvTree& tree) {
    ++epoch_;
    int64_t n = 0;
    for (int32_t s : tree.slots) {
      uint32_t& st = stamp_[static_cast<size_t>(s)];
      if (st != epoch_) {
        st = epoch_;
        ++n;
      }
    }
    return n;
  }

 private:
  std::vector<uint32_t> stamp_;
  uint32_t epoch_ = 0;
};

void submit_all(Scheduler& scheduler, const std::vector<GenerationRequest>& requests) {
  for (const GenerationRequest& r : requests) scheduler.submit(r);
}

}  // namespace

double weight_bytes_bf16(const ModelConfig& config) { return static_cast<double>(config.num_params()) * 2.0; }

double kv_bytes_per_token_bf16(const ModelConfig& config) {
  return static_cast<double>(config.num_hidden_layers) * 2.0 * config.num_key_value_heads * config.head_dim * 2.0;
}

E2eMeasurement run_e2e(DecoderModel& model, const std::vector<GenerationRequest>& requests, const E2eRunOptions& options) {
  FT_CHECK(options.profile_every >= 0, "profile_every must be >= 0");
  Scheduler scheduler(model, options.scheduler);
  submit_all(scheduler, requests);
  E2eMeasurement m;
  m.requests = static_cast<int64_t>(requests.size());
  for (const GenerationRequest& r : requests) {
    m.sequences += r.n;
    m.generated_tokens += int64_t{r.n} * r.max_new_tokens;
  }
  const double weight_bytes = weight_bytes_bf16(model.config());
  const double kv_per_token = kv_bytes_per_token_bf16(model.config());
  DistinctSlots distinct(model.num_slots());
  ProgressBar bar(options.progress, options.label, m.generated_tokens);
  model.set_profiling(false);
  model.reset_times();

  double step_ms_sum = 0, floor_ms_sum = 0, unique_sum = 0;
  double attention = 0, gemm = 0, other = 0, comm = 0;
  int64_t unique = 0, last_batch = 0;
  while (!scheduler.idle()) {
    const SchedulerStats before = scheduler.stats();
    const bool profile = options.profile_every > 0 && m.decode_steps % options.profile_every == 0;
    DecodeTimes t_before;
    if (profile) {
      model.set_profiling(true);
      t_before = model.decode_times();
    }
    const auto t0 = Clock::now();
    scheduler.step();
    const auto t1 = Clock::now();
    const SchedulerStats& after = scheduler.stats();
    const double wall_ms = ms_since(t0, t1);
    m.seconds += wall_ms / 1e3;
    if (profile) {
      const DecodeTimes t_after = model.decode_times();
      model.set_profiling(false);
      if (after.decode_steps > before.decode_steps && t_after.steps > t_before.steps) {
        ++m.profiled_steps;
        attention += t_after.attention_ms - t_before.attention_ms;
        gemm += t_after.gemm_ms - t_before.gemm_ms;
        other += t_after.other_ms - t_before.other_ms;
        comm += t_after.comm_ms - t_before.comm_ms;
      }
    }
    if (after.decode_steps > before.decode_steps) {
      ++m.decode_steps;
      const int64_t batch = after.decode_tokens - before.decode_tokens;
      last_batch = batch;
      step_ms_sum += wall_ms - (after.prefill_ms - before.prefill_ms);
      unique = after.tree_rebuilds > before.tree_rebuilds ? distinct.count(scheduler.last_tree()) : unique + batch;
      unique_sum += static_cast<double>(unique);
      floor_ms_sum += (weight_bytes + static_cast<double>(unique) * kv_per_token) / kH200ReadBytesPerS * 1e3;
    }
    bar.update(after.generated_tokens, last_batch);
  }
  bar.finish();
  scheduler.take_finished();

  const SchedulerStats& s = scheduler.stats();
  FT_CHECK(s.generated_tokens == m.generated_tokens,
           "bench-e2e: generated " + std::to_string(s.generated_tokens) + " tokens, expected " +
               std::to_string(m.generated_tokens) + " (early stop?)");
  m.tokens_per_s = m.seconds > 0 ? static_cast<double>(m.generated_tokens) / m.seconds : 0.0;
  m.max_batch = s.max_batch;
  m.prefill_s = s.prefill_ms / 1e3;
  m.prefill_tokens = s.prefill_tokens;
  m.cache_hit_rate = s.cache_hit_rate();
  if (m.decode_steps > 0) {
    const double steps = static_cast<double>(m.decode_steps);
    m.mean_batch = static_cast<double>(s.decode_tokens) / steps;
    m.decode_step_ms = step_ms_sum / steps;
    m.plan_ms_per_step = s.plan_ms / steps;
    m.mean_unique_kv_tokens = unique_sum / steps;
    m.floor_step_ms = floor_ms_sum / steps;
  }
  if (m.profiled_steps > 0) {
    const double p = static_cast<double>(m.profiled_steps);
    m.attention_ms = attention / p;
    m.gemm_ms = gemm / p;
    m.other_ms = other / p;
    m.comm_ms = comm / p;
  }
  return m;
}

AgreementCheck check_greedy_agreement(DecoderModel& model, const std::vector<GenerationRequest>& requests,
                                      const SchedulerOptions& base, double tie_tol) {
  FT_CHECK(tie_tol >= 0, "tie tolerance must be >= 0");
  AgreementCheck out;
  out.tie_tol = tie_tol;
  out.min_fasttree_margin = std::numeric_limits<double>::infinity();
  for (const GenerationRequest& r : requests) {
    FT_CHECK(r.sampling.temperature == 0.0f, "check: requests must be greedy");
    out.sequences += r.n;
    out.tokens_per_sequence = std::max<int64_t>(out.tokens_per_sequence, r.max_new_tokens);
  }

  // Per-request run first: its tokens are the reference the FastTree run's logits are compared to.
  SchedulerOptions pr = base;
  pr.sharing = PathSharing::kPerRequest;
  pr.on_token_logits = [](const TokenLogits&) {};  // same logits path (model.decode) as the FastTree run
  std::vector<GenerationResult> ref;
  {
    Scheduler s(model, pr);
    submit_all(s, requests);
    ref = s.run();
  }
  FT_CHECK(ref.size() == requests.size(), "check: per-request run lost requests");

  // FastTree run: at each token, the gap between its greedy choice and the per-request token.
  struct Seen {
    double gap = 0, top = 0;
  };
  std::vector<std::vector<std::vector<Seen>>> seen(requests.size());
  for (size_t i = 0; i < requests.size(); ++i)
    seen[i].assign(static_cast<size_t>(requests[i].n), std::vector<Seen>(static_cast<size_t>(requests[i].max_new_tokens)));
  SchedulerOptions ft = base;
  ft.sharing = PathSharing::kShared;
  ft.on_token_logits = [&](const TokenLogits& t) {
    const auto& want = ref[static_cast<size_t>(t.request_id)].samples[static_cast<size_t>(t.sample)];
    const int32_t top = greedy_token(t.logits);
    double second = -std::numeric_limits<double>::infinity();
    for (size_t v = 0; v < t.logits.size(); ++v)
      if (static_cast<int32_t>(v) != top) second = std::max(second, static_cast<double>(t.logits[v]));
    if (t.logits.size() > 1) out.min_fasttree_margin = std::min(out.min_fasttree_margin, t.logits[static_cast<size_t>(top)] - second);
    if (t.index < static_cast<int64_t>(want.size())) {
      Seen& e = seen[static_cast<size_t>(t.request_id)][static_cast<size_t>(t.sample)][static_cast<size_t>(t.index)];
      e.top = t.logits[static_cast<size_t>(top)];
      e.gap = e.top - t.logits[static_cast<size_t>(want[static_cast<size_t>(t.index)])];
    }
  };
  std::vector<GenerationResult> got;
  {
    Scheduler s(model, ft);
    submit_all(s, requests);
    got = s.run();
  }
  FT_CHECK(got.size() == requests.size(), "check: FastTree run lost requests");

  for (size_t i = 0; i < requests.size(); ++i) {
    for (size_t k = 0; k < got[i].samples.size(); ++k) {
      const auto& a = got[i].samples[k];
      const auto& b = ref[i].samples[k];
      const auto mm = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
      if (mm.first == a.end() && mm.second == b.end()) {
        ++out.agree;
        continue;
      }
      FT_CHECK(mm.first != a.end() && mm.second != b.end(), "check: runs generated different numbers of tokens");
      Divergence d;
      d.request = static_cast<int64_t>(i);
      d.sample = static_cast<int>(k);
      d.index = mm.first - a.begin();
      d.fasttree_token = *mm.first;
      d.per_request_token = *mm.second;
      const Seen& e = seen[i][k][static_cast<size_t>(d.index)];
      d.gap = e.gap;
      d.tolerance = tie_tol * std::max(1.0, std::abs(e.top));
      (d.tie() ? out.ties : out.mismatches) += 1;
      out.divergences.push_back(d);
    }
  }
  if (!std::isfinite(out.min_fasttree_margin)) out.min_fasttree_margin = 0;
  return out;
}

}  // namespace fasttree
