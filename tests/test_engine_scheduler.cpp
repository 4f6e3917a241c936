// Scheduler (engine/scheduler.h) and plan extension (engine/plan_extend.h) on a tiny random model:
//   * greedy outputs of batched, continuously scheduled requests == each request decoded alone
//     (full prefill + token-by-token decode with reference attention, no cache), for shared and
//     per-request trees, with and without plan extension, and with reference attention;
//   * prefix-cache hits: exact cached token counts (prompt prefixes, whole prompts, generated tokens);
//   * a small KV pool: requests wait, LRU eviction happens, every request completes with the same
//     outputs, the slot accounting holds after every step;
//   * n-sample forks share the prompt's slots, and sample i == a lone request with seed + i;
//   * re-planning only when the batch changes (exact counts), new arrivals mid-run;
//   * stop tokens, max_new_tokens 0 and 1, and one-line errors for requests that can never run;
//   * batched prefill: any batch size gives the outputs of one request per call, and no prefill or
//     decode ever reads a KV slot before it was written (RecordingModel);
//   * extend_plan: a patched plan is valid (validate_plan) and computes the grown tree's attention.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/executor.h"
#include "cpu/reference.h"
#include "engine/cpu_model.h"
#include "engine/plan_extend.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/slot_paths.h"
#include "engine/weights.h"
#include "engine_test_util.h"
#include "plan/plan_validate.h"
#include "plan/planner.h"

namespace fasttree {
namespace {

using test::expect_error;
using Vec = std::vector<int32_t>;

constexpr int kThreads = 2;

const ModelWeights& tiny_weights() {
  static const ModelWeights w = random_weights(model_preset("tiny"), 77);
  return w;
}

CpuModelOptions model_options() {
  CpuModelOptions o;
  o.num_threads = kThreads;
  return o;
}

// Planner settings that split tiny contexts into chunks (exercises chunked plans and extension limits).
PlannerConfig splitting_planner() {
  PlannerConfig p = engine_planner_config();
  p.num_sms = 64;
  p.min_chunk = 4;
  p.split_waves = 1.0;
  p.tile_classes[0] = {64, 4};  // chunks round up to whole KV tiles: keep them small
  p.tile_classes[1] = {16, 4};
  return p;
}

Vec random_tokens(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Vec t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng() % 256);
  return t;
}

Vec concat(Vec a, const Vec& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A request decoded alone, without the scheduler or the cache: full prefill, then one token per
// step through reference attention on a chain.
Vec decode_alone(const Vec& prompt, int max_new, const SamplingParams& sp = {}, const Vec& stop = {}) {
  const int64_t p = static_cast<int64_t>(prompt.size());
  CpuModel m(tiny_weights(), static_cast<int32_t>(p + max_new), model_options());
  Vec slots(static_cast<size_t>(p));
  std::iota(slots.begin(), slots.end(), 0);
  std::vector<float> logits = m.prefill(prompt, slots, slots, {});
  Sampler sampler(sp);
  Vec out;
  for (int i = 0; i < max_new; ++i) {
    out.push_back(sampler.sample(logits));
    if (i + 1 == max_new || std::find(stop.begin(), stop.end(), out.back()) != stop.end()) break;
    const int32_t slot = static_cast<int32_t>(slots.size());
    slots.push_back(slot);
    const std::vector<Vec> paths = {slots};
    const KvTree tree = kv_tree_from_paths(paths);
    const Vec tok = {out.back()}, pos = {slot}, sl = {slot};
    logits = m.decode({tok, pos, sl, &tree}, DecodeAttention::kReference);
  }
  return out;
}

GenerationRequest greedy_request(Vec prompt, int max_new) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new;
  return r;
}

// Prompts sharing prefixes at several depths, plus unrelated ones; lengths 1..30.
std::vector<GenerationRequest> mixed_requests() {
  const Vec sys = random_tokens(12, 1);
  const Vec doc = random_tokens(6, 2);
  std::vector<GenerationRequest> reqs;
  reqs.push_back(greedy_request(concat(sys, random_tokens(4, 10)), 7));
  reqs.push_back(greedy_request(concat(concat(sys, doc), random_tokens(3, 11)), 5));
  reqs.push_back(greedy_request(concat(concat(sys, doc), random_tokens(5, 12)), 8));
  reqs.push_back(greedy_request(random_tokens(9, 13), 6));
  reqs.push_back(greedy_request(sys, 4));  // a prompt that is a prefix of the others
  reqs.push_back(greedy_request(random_tokens(1, 14), 3));
  reqs.push_back(greedy_request(concat(concat(sys, doc), random_tokens(3, 11)), 5));  // duplicate of #1
  return reqs;
}

std::vector<GenerationResult> run_all(Scheduler& s, const std::vector<GenerationRequest>& reqs) {
  for (const auto& r : reqs) s.submit(r);
  while (s.step()) s.check_invariants();
  auto out = s.take_finished();
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return out;
}

TEST(EngineScheduler, BatchedGreedyEqualsEachRequestAlone) {
  const auto reqs = mixed_requests();
  std::vector<Vec> want;
  for (const auto& r : reqs) want.push_back(decode_alone(r.prompt, r.max_new_tokens));

  struct Mode {
    const char* name;
    SchedulerOptions opt;
  };
  std::vector<Mode> modes;
  modes.push_back({"fasttree", {}});
  SchedulerOptions split;
  split.planner = splitting_planner();
  modes.push_back({"fasttree_split", split});
  SchedulerOptions replan;
  replan.extend_plans = false;
  modes.push_back({"replan_every_step", replan});
  SchedulerOptions per_request;
  per_request.sharing = PathSharing::kPerRequest;
  modes.push_back({"per_request", per_request});
  SchedulerOptions reference;
  reference.attention = DecodeAttention::kReference;
  modes.push_back({"reference", reference});
  SchedulerOptions small_batch;
  small_batch.max_running = 2;
  modes.push_back({"max_running_2", small_batch});

  for (const Mode& mode : modes) {
    SCOPED_TRACE(mode.name);
    CpuModelOptions mo = model_options();
    mo.planner = mode.opt.planner;
    CpuModel model(tiny_weights(), 512, mo);
    Scheduler s(model, mode.opt);
    const auto got = run_all(s, reqs);
    ASSERT_EQ(got.size(), reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].id, static_cast<int64_t>(i));
      ASSERT_EQ(got[i].samples.size(), 1u);
      EXPECT_EQ(got[i].samples[0], want[i]) << "request " << i;
    }
    EXPECT_EQ(s.stats().requests_finished, static_cast<int64_t>(reqs.size()));
    EXPECT_EQ(s.num_running(), 0u);
    EXPECT_EQ(s.reserved_slots(), 0);
    EXPECT_EQ(s.cache().locked_tokens(), 0);
    if (mode.opt.max_running == 2) EXPECT_LE(s.stats().max_batch, 2);
  }
}

TEST(EngineScheduler, PrefixCacheHitCounts) {
  CpuModel model(tiny_weights(), 512, model_options());
  Scheduler s(model);
  const Vec sys = random_tokens(10, 3);
  const Vec a = concat(sys, random_tokens(5, 4));  // 15 tokens

  s.submit(greedy_request(a, 4));
  auto r = s.run();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].cached_tokens, 0);
  const Vec a_out = r[0].samples[0];

  // Shares the 10-token system prompt.
  s.submit(greedy_request(concat(sys, random_tokens(3, 5)), 2));
  r = s.run();
  EXPECT_EQ(r[0].cached_tokens, 10);

  // The same prompt again: everything but the last token (whose logits are needed) is reused.
  s.submit(greedy_request(a, 4));
  r = s.run();
  EXPECT_EQ(r[0].cached_tokens, 14);
  EXPECT_EQ(r[0].samples[0], a_out);

  // The prompt followed by its first 3 generated tokens: generated tokens were cached too (the 4th
  // generated token was never fed, so it is not).
  const Vec cont = concat(a, Vec(a_out.begin(), a_out.begin() + 3));
  s.submit(greedy_request(concat(cont, {a_out[3], 9}), 2));
  r = s.run();
  EXPECT_EQ(r[0].cached_tokens, static_cast<int64_t>(cont.size()));

  // Two requests submitted together, sharing a new prefix: the second one hits what the first
  // one's prefill inserted in the same admission round.
  const Vec fresh = random_tokens(8, 6);
  s.submit(greedy_request(concat(fresh, {1, 2}), 3));
  s.submit(greedy_request(concat(fresh, {3, 4}), 3));
  r = s.run();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].cached_tokens, 0);
  EXPECT_EQ(r[1].cached_tokens, 8);

  const SchedulerStats& st = s.stats();
  EXPECT_EQ(st.cached_prompt_tokens, 10 + 14 + static_cast<int64_t>(cont.size()) + 8);
  EXPECT_EQ(st.prefill_tokens, st.prompt_tokens - st.cached_prompt_tokens);
  EXPECT_GT(st.cache_hit_rate(), 0.4);

  // Without caching generated tokens, only prompts are reused.
  CpuModel model2(tiny_weights(), 512, model_options());
  SchedulerOptions o;
  o.cache_generated = false;
  Scheduler s2(model2, o);
  s2.submit(greedy_request(a, 4));
  s2.run();
  s2.submit(greedy_request(concat(cont, {a_out[3], 9}), 2));
  r = s2.run();
  EXPECT_EQ(r[0].cached_tokens, static_cast<int64_t>(a.size()));
  EXPECT_EQ(s2.pool().num_used(), s2.cache().total_tokens());
}

TEST(EngineScheduler, SmallPoolEvictsAndCompletesEverything) {
  // 8 requests of 23 slots each (16-token prompts sharing 6 tokens pairwise, 8 new tokens) into a
  // 50-slot pool: at most two run at once, finished prefixes must be evicted for later ones.
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 8; ++i) {
    const Vec shared = random_tokens(6, 100 + i / 2);
    reqs.push_back(greedy_request(concat(shared, random_tokens(10, 200 + i)), 8));
  }
  CpuModel big_model(tiny_weights(), 1024, model_options());
  Scheduler big(big_model);
  const auto want = run_all(big, reqs);
  EXPECT_EQ(big.stats().evicted_tokens, 0);

  CpuModel small_model(tiny_weights(), 50, model_options());
  Scheduler small(small_model);
  const auto got = run_all(small, reqs);  // checks the invariants after every step
  ASSERT_EQ(got.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i].samples, want[i].samples) << "request " << i;
  EXPECT_GT(small.stats().evicted_tokens, 0);
  EXPECT_GT(small.stats().admission_waits, 0);
  EXPECT_LE(small.stats().max_batch, 2);
  EXPECT_LE(small.pool().num_used(), 50);
  // Pairs share 6 prompt tokens; whether the partner's prefix survived depends on eviction order,
  // but every cached token count is one of the two possibilities.
  for (const auto& r : got) EXPECT_TRUE(r.cached_tokens == 0 || r.cached_tokens == 6) << r.cached_tokens;

  // A pool exactly as large as one request still runs them all, one at a time.
  CpuModel tight_model(tiny_weights(), 23, model_options());
  Scheduler tight(tight_model);
  const auto got2 = run_all(tight, reqs);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got2[i].samples, want[i].samples) << "request " << i;
  EXPECT_EQ(tight.stats().max_batch, 1);
}

TEST(EngineScheduler, RejectsRequestsThatCanNeverRun) {
  CpuModel model(tiny_weights(), 40, model_options());
  SchedulerOptions o;
  o.max_running = 8;
  Scheduler s(model, o);
  expect_error([&] { s.submit(greedy_request(random_tokens(20, 1), 22)); },
               {"request 0", "needs 41 KV slots", "holds 40", "never"});
  GenerationRequest fork = greedy_request(random_tokens(10, 1), 5);
  fork.n = 8;  // 10 + 8 * 4 = 42
  expect_error([&] { s.submit(fork); }, {"needs 42 KV slots"});
  expect_error([&] { s.submit(greedy_request({}, 2)); }, {"empty prompt"});
  expect_error([&] { s.submit(greedy_request({1, 256, 3}, 2)); }, {"token 256", "position 1", "[0, 256)"});
  expect_error([&] { s.submit(greedy_request({1, -1}, 2)); }, {"token -1"});
  expect_error([&] { s.submit(greedy_request({1}, -1)); }, {"max_new_tokens must be >= 0"});
  GenerationRequest bad_n = greedy_request({1}, 2);
  bad_n.n = 0;
  expect_error([&] { s.submit(bad_n); }, {"n must be in [1, 8]"});
  bad_n.n = 9;
  expect_error([&] { s.submit(bad_n); }, {"n must be in [1, 8]"});
  GenerationRequest bad_p = greedy_request({1}, 2);
  bad_p.sampling.temperature = 1.0f;
  bad_p.sampling.top_p = 0.0f;
  expect_error([&] { s.submit(bad_p); }, {"request 0"});
  EXPECT_TRUE(s.idle());
  EXPECT_EQ(s.stats().requests_submitted, 0);
  // Exactly the pool's size is fine.
  s.submit(greedy_request(random_tokens(20, 1), 21));
  const auto r = s.run();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].samples[0].size(), 21u);

  // Sliding window (mistral): a context beyond it is rejected up front.
  ModelConfig mc = model_preset("tiny");
  mc.model_type = "mistral";
  mc.sliding_window = 16;
  CpuModel mistral(random_weights(mc, 3), 64, model_options());
  Scheduler sm(mistral);
  expect_error([&] { sm.submit(greedy_request(random_tokens(10, 1), 8)); }, {"sliding window of 16"});
  sm.submit(greedy_request(random_tokens(10, 1), 7));  // context 16: fine
  EXPECT_EQ(sm.run().size(), 1u);
}

TEST(EngineScheduler, ForkSharesThePromptAndMatchesLoneSamples) {
  CpuModel model(tiny_weights(), 256, model_options());
  Scheduler s(model);
  GenerationRequest req = greedy_request(random_tokens(13, 8), 6);
  req.n = 4;
  req.sampling.temperature = 1.5f;
  req.sampling.top_k = 40;
  req.sampling.seed = 1000;
  s.submit(req);
  ASSERT_TRUE(s.step());  // prefill + first decode step
  EXPECT_EQ(s.num_running(), 4u);
  EXPECT_EQ(s.stats().prefill_tokens, 13);
  // One copy of the prompt plus each sample's 5 generated-token slots, allocated at admission (one
  // fed so far per sample).
  EXPECT_EQ(s.pool().num_used(), 13 + 4 * 5);
  EXPECT_EQ(s.reserved_slots(), 4 * 4);
  const KvTree& tree = s.last_tree();
  EXPECT_EQ(tree.num_tokens(), 13 + 4);
  EXPECT_EQ(tree.num_queries(), 4);
  const int shared_node = tree.parent[tree.query_node[0]];
  ASSERT_GE(shared_node, 0);
  for (int q = 0; q < 4; ++q) {
    EXPECT_EQ(tree.parent[tree.query_node[q]], shared_node);
    EXPECT_EQ(tree.node_len(tree.query_node[q]), 1);
  }
  s.check_invariants();
  ASSERT_TRUE(s.step());
  ASSERT_TRUE(s.step());
  // Each sample's generated tokens sit in one run of consecutive slots.
  for (int q = 0; q < 4; ++q) {
    const auto tail = s.last_tree().node_slots(s.last_tree().query_node[q]);
    ASSERT_EQ(tail.size(), 3u);
    for (size_t i = 1; i < tail.size(); ++i) EXPECT_EQ(tail[i], tail[i - 1] + 1) << "sample " << q;
  }
  while (s.step()) s.check_invariants();
  const auto r = s.take_finished();
  ASSERT_EQ(r.size(), 1u);
  ASSERT_EQ(r[0].samples.size(), 4u);
  std::vector<Vec> distinct;
  for (int i = 0; i < 4; ++i) {
    SamplingParams sp = req.sampling;
    sp.seed = req.sampling.seed + static_cast<uint64_t>(i);
    EXPECT_EQ(r[0].samples[static_cast<size_t>(i)], decode_alone(req.prompt, 6, sp)) << "sample " << i;
    if (std::find(distinct.begin(), distinct.end(), r[0].samples[static_cast<size_t>(i)]) == distinct.end())
      distinct.push_back(r[0].samples[static_cast<size_t>(i)]);
  }
  EXPECT_GT(distinct.size(), 1u);  // the samples really differ at temperature 1.5

  // Greedy forks are identical; after they finish the cache holds their common continuation once.
  CpuModel model2(tiny_weights(), 256, model_options());
  Scheduler s2(model2);
  GenerationRequest g = greedy_request(req.prompt, 6);
  g.n = 3;
  s2.submit(g);
  const auto r2 = s2.run();
  EXPECT_EQ(r2[0].samples, std::vector<Vec>(3, decode_alone(req.prompt, 6)));
  EXPECT_EQ(s2.cache().total_tokens(), 13 + 5);
  EXPECT_EQ(s2.pool().num_used(), 13 + 5);
}

TEST(EngineScheduler, ReplansOnlyWhenTheBatchChanges) {
  const Vec sys = random_tokens(10, 21);
  std::vector<GenerationRequest> reqs = {greedy_request(concat(sys, {1}), 4), greedy_request(concat(sys, {2}), 6),
                                         greedy_request(concat(sys, {3}), 8)};
  // Exact counts need plans that never have to be re-chunked: no context splitting here (the
  // splitting case is at the end).
  SchedulerOptions counting;
  counting.planner.split = false;
  CpuModel model(tiny_weights(), 256, model_options());
  Scheduler s(model, counting);
  const auto got = run_all(s, reqs);
  // Decode steps 1..7; the batch changes before step 1 (all join), after step 3 (request 0 has its
  // 4 tokens) and after step 5 (request 1): three plans, four extensions.
  EXPECT_EQ(s.stats().decode_steps, 7);
  EXPECT_EQ(s.stats().plans, 3);
  EXPECT_EQ(s.stats().tree_rebuilds, 3);
  EXPECT_EQ(s.stats().plan_extensions, 4);
  EXPECT_EQ(s.stats().decode_tokens, 3 + 3 + 3 + 2 + 2 + 1 + 1);

  SchedulerOptions o = counting;
  o.extend_plans = false;
  CpuModel model2(tiny_weights(), 256, model_options());
  Scheduler s2(model2, o);
  const auto got2 = run_all(s2, reqs);
  EXPECT_EQ(s2.stats().plans, 7);
  EXPECT_EQ(s2.stats().plan_extensions, 0);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i].samples, got2[i].samples);

  // A request arriving mid-run changes the batch: one more plan, at its first decode step.
  CpuModel model3(tiny_weights(), 256, model_options());
  Scheduler s3(model3, counting);
  s3.submit(reqs[2]);  // 8 tokens: 7 decode steps
  ASSERT_TRUE(s3.step());
  ASSERT_TRUE(s3.step());
  EXPECT_EQ(s3.stats().plans, 1);
  EXPECT_EQ(s3.stats().plan_extensions, 1);
  s3.submit(reqs[0]);  // joins at step 3, finishes after step 5
  while (s3.step()) s3.check_invariants();
  EXPECT_EQ(s3.stats().decode_steps, 7);
  EXPECT_EQ(s3.stats().plans, 3);  // step 1, step 3 (join), step 6 (leave)
  EXPECT_EQ(s3.stats().plan_extensions, 4);
  const auto r3 = s3.take_finished();
  ASSERT_EQ(r3.size(), 2u);
  for (const auto& r : r3) EXPECT_EQ(r.samples[0], r.id == 0 ? got[2].samples[0] : got[0].samples[0]);

  // With context splitting, a last chunk that would outgrow its vnode's first chunk forces a
  // re-plan, and the outputs do not change.
  SchedulerOptions so;
  so.planner = splitting_planner();
  CpuModelOptions mo = model_options();
  mo.planner = so.planner;
  CpuModel model4(tiny_weights(), 256, mo);
  Scheduler s4(model4, so);
  std::vector<GenerationRequest> long_reqs = {greedy_request(concat(sys, {1}), 20), greedy_request(concat(sys, {2}), 20)};
  const auto got4 = run_all(s4, long_reqs);
  for (size_t i = 0; i < long_reqs.size(); ++i)
    EXPECT_EQ(got4[i].samples[0], decode_alone(long_reqs[i].prompt, 20)) << "request " << i;
  EXPECT_EQ(s4.stats().plans + s4.stats().plan_extensions, s4.stats().decode_steps);
  EXPECT_GT(s4.stats().plan_extensions, 0);
  EXPECT_GT(s4.stats().plans, 1);  // the batch never changed before the end: chunk growth re-planned
  EXPECT_GT(s4.last_plan().num_items(), s4.last_plan().num_vnodes());
}

TEST(EngineScheduler, StopTokensAndShortRequests) {
  const Vec prompt = random_tokens(7, 31);
  const Vec full = decode_alone(prompt, 8);
  CpuModel model(tiny_weights(), 256, model_options());
  Scheduler s(model);
  GenerationRequest stop = greedy_request(prompt, 8);
  stop.stop_tokens = {full[2]};
  const Vec want_stop = decode_alone(prompt, 8, {}, stop.stop_tokens);
  ASSERT_LE(want_stop.size(), 3u);
  s.submit(stop);
  s.submit(greedy_request(prompt, 0));
  s.submit(greedy_request(prompt, 1));
  const auto r = s.run();
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].samples[0], want_stop);
  EXPECT_EQ(r[0].samples[0].back(), full[2]);
  EXPECT_TRUE(r[1].samples[0].empty());
  EXPECT_EQ(r[2].samples[0], Vec{full[0]});
  EXPECT_EQ(s.reserved_slots(), 0);
  s.check_invariants();
  EXPECT_FALSE(s.step());
}

// Wraps a model and checks the KV contract the scheduler relies on: every slot a prefill sequence
// or a decode step reads was written before (by an earlier call or an earlier sequence of the same
// batch), and no slot is written twice while in use. Records the batch sizes.
class RecordingModel final : public DecoderModel {
 public:
  explicit RecordingModel(DecoderModel& inner) : inner_(inner), written_(static_cast<size_t>(inner.num_slots()), 0) {}
  const ModelConfig& config() const override { return inner_.config(); }
  int32_t num_slots() const override { return inner_.num_slots(); }
  std::vector<float> prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                             std::span<const int32_t> slots, std::span<const int32_t> context_slots,
                             bool all_logits) override {
    const PrefillSeq one{tokens, positions, slots, context_slots};
    record({&one, 1});
    return inner_.prefill(tokens, positions, slots, context_slots, all_logits);
  }
  std::vector<float> prefill_batch(std::span<const PrefillSeq> seqs) override {
    record(seqs);
    batch_sizes.push_back(static_cast<int>(seqs.size()));
    return inner_.prefill_batch(seqs);
  }
  std::vector<float> decode(const DecodeBatch& batch, DecodeAttention attention) override {
    for (int v = 0; v < batch.tree->num_nodes(); ++v)
      for (int32_t slot : batch.tree->node_slots(v)) {
        const bool fresh = std::find(batch.slots.begin(), batch.slots.end(), slot) != batch.slots.end();
        EXPECT_TRUE(fresh || written_[static_cast<size_t>(slot)]) << "decode reads unwritten slot " << slot;
      }
    for (int32_t slot : batch.slots) written_[static_cast<size_t>(slot)] = 1;
    return inner_.decode(batch, attention);
  }
  std::vector<int> batch_sizes;

 private:
  void record(std::span<const PrefillSeq> seqs) {
    for (const PrefillSeq& q : seqs) {
      for (int32_t slot : q.context_slots)
        EXPECT_TRUE(written_[static_cast<size_t>(slot)]) << "prefill reads unwritten slot " << slot;
      for (int32_t slot : q.slots) written_[static_cast<size_t>(slot)] = 1;
    }
  }
  DecoderModel& inner_;
  std::vector<uint8_t> written_;
};

TEST(EngineScheduler, BatchedPrefillEqualsOneRequestPerCall) {
  // mixed_requests (shared prefixes, a prompt that prefixes the others, a duplicate prompt whose
  // last token is computed twice) plus forks and one-token requests, all submitted at once.
  std::vector<GenerationRequest> reqs = mixed_requests();
  GenerationRequest fork = greedy_request(concat(random_tokens(12, 1), random_tokens(2, 40)), 4);
  fork.n = 3;
  reqs.push_back(fork);
  reqs.push_back(greedy_request(random_tokens(5, 41), 1));  // finishes at its prefill
  reqs.push_back(reqs[0]);                                   // fully cached but its last token

  auto run = [&](int64_t max_prefill, SchedulerStats& stats, std::vector<int>& sizes) {
    CpuModel cpu(tiny_weights(), 512, model_options());
    RecordingModel model(cpu);
    SchedulerOptions o;
    o.max_prefill_tokens = max_prefill;
    Scheduler s(model, o);
    auto out = run_all(s, reqs);  // checks the invariants after every step
    EXPECT_EQ(s.reserved_slots(), 0);
    stats = s.stats();
    sizes = model.batch_sizes;
    return out;
  };
  SchedulerStats one_stats, all_stats, some_stats;
  std::vector<int> one_sizes, all_sizes, some_sizes;
  const auto one = run(1, one_stats, one_sizes);
  const auto all = run(1 << 20, all_stats, all_sizes);
  const auto some = run(20, some_stats, some_sizes);
  ASSERT_EQ(one.size(), reqs.size());
  ASSERT_EQ(all.size(), reqs.size());
  ASSERT_EQ(some.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(all[i].samples, one[i].samples) << "request " << i;
    EXPECT_EQ(some[i].samples, one[i].samples) << "request " << i;
    EXPECT_EQ(all[i].cached_tokens, one[i].cached_tokens) << "request " << i;
    EXPECT_EQ(some[i].cached_tokens, one[i].cached_tokens) << "request " << i;
  }
  // One request per call vs one call for everything vs calls of >= 20 tokens.
  EXPECT_EQ(one_stats.prefill_calls, static_cast<int64_t>(reqs.size()));
  EXPECT_TRUE(std::all_of(one_sizes.begin(), one_sizes.end(), [](int n) { return n == 1; }));
  EXPECT_EQ(all_stats.prefill_calls, 1);
  EXPECT_EQ(all_sizes, std::vector<int>{static_cast<int>(reqs.size())});
  EXPECT_GT(some_stats.prefill_calls, 1);
  EXPECT_LT(some_stats.prefill_calls, static_cast<int64_t>(reqs.size()));
  EXPECT_EQ(all_stats.prefill_tokens, one_stats.prefill_tokens);
  EXPECT_EQ(all_stats.cached_prompt_tokens, one_stats.cached_prompt_tokens);
  EXPECT_GT(all_stats.cached_prompt_tokens, 12 * 4);  // the shared prefixes were reused inside the batch
}

TEST(EngineScheduler, PrefillBatchSlotRules) {
  const Vec tok3 = {1, 2, 3}, pos3 = {0, 1, 2}, tok1 = {4}, pos1 = {3};
  const Vec a = {10, 11, 12}, b = {20}, ctx_a = {10, 11, 12}, bad = {13, 14, 11}, ctx_late = {20}, ctx_self = {21};
  std::vector<int32_t> scratch;
  // Sequence 1 continues sequence 0 (reads its slots): fine, and the scratch is left all -1.
  const std::vector<PrefillSeq> ok = {{tok3, pos3, a, {}}, {tok1, pos1, b, ctx_a}};
  check_prefill_batch_slots(ok, 32, scratch);
  EXPECT_EQ(scratch, std::vector<int32_t>(32, -1));
  // Slot 11 written twice: the error names both sequences; the partly marked second sequence
  // (13, 14) is unmarked too, so the same slots pass in the next batch.
  const std::vector<PrefillSeq> twice = {{tok3, pos3, a, {}}, {tok3, pos3, bad, {}}};
  expect_error([&] { check_prefill_batch_slots(twice, 32, scratch); }, {"slot 11", "sequences 0 and 1"});
  EXPECT_EQ(scratch, std::vector<int32_t>(32, -1));
  const Vec c = {13, 14, 15};
  const std::vector<PrefillSeq> reuse = {{tok3, pos3, c, {}}};
  check_prefill_batch_slots(reuse, 32, scratch);
  // A context slot written by a later sequence, or by the sequence itself.
  const std::vector<PrefillSeq> late = {{tok3, pos3, a, ctx_late}, {tok1, pos1, b, {}}};
  expect_error([&] { check_prefill_batch_slots(late, 32, scratch); }, {"sequence 0's context slot 20", "sequence 1"});
  const Vec self = {21};
  const std::vector<PrefillSeq> own = {{tok1, pos1, self, ctx_self}};
  expect_error([&] { check_prefill_batch_slots(own, 32, scratch); }, {"context slot 21", "sequence 0"});
  EXPECT_EQ(scratch, std::vector<int32_t>(32, -1));
  // The default DecoderModel::prefill_batch (CpuModel) applies the same rules and the slot range.
  CpuModel model(tiny_weights(), 32, model_options());
  expect_error([&] { model.prefill_batch(twice); }, {"slot 11", "sequences 0 and 1"});
  const Vec far = {40};
  const std::vector<PrefillSeq> out_of_range = {{tok1, pos1, far, {}}};
  expect_error([&] { model.prefill_batch(out_of_range); }, {"slot 40 out of range [0, 32)"});
  EXPECT_EQ(model.prefill_batch(ok).size(), 2u * 256u);
}

TEST(EngineScheduler, BatchedPrefillWaitsForRoomAndRespectsMaxRunning) {
  // 6 requests of 16 + 7 slots into a 60-slot pool (two fit at once) and max_running 2: batches
  // hold at most what fits; everything completes with the outputs of a roomy engine.
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(greedy_request(random_tokens(16, 300 + i), 8));
  CpuModel roomy(tiny_weights(), 1024, model_options());
  Scheduler big(roomy);
  const auto want = run_all(big, reqs);
  CpuModel cpu(tiny_weights(), 60, model_options());
  RecordingModel model(cpu);
  SchedulerOptions o;
  o.max_running = 2;
  Scheduler s(model, o);
  const auto got = run_all(s, reqs);
  ASSERT_EQ(got.size(), reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i].samples, want[i].samples) << "request " << i;
  for (int n : model.batch_sizes) EXPECT_LE(n, 2);
  EXPECT_LE(s.stats().max_batch, 2);
  expect_error([&] {
    SchedulerOptions bad;
    bad.max_prefill_tokens = 0;
    Scheduler x(cpu, bad);
  }, {"max_prefill_tokens must be positive"});
}

// ---- extend_plan -------------------------------------------------------------------------------

// A batch tree like the scheduler's: shared prefixes, one private non-empty tail leaf per query.
KvTree batch_tree(int queries, uint64_t seed, int32_t& next_slot) {
  std::mt19937_64 rng(seed);
  KvTree t;
  const int root = t.add_node(-1, 3 + static_cast<int64_t>(rng() % 20));
  const int mid_a = t.add_node(root, 1 + static_cast<int64_t>(rng() % 15));
  const int mid_b = t.add_node(root, 1 + static_cast<int64_t>(rng() % 15));
  const int other = t.add_node(-1, 1 + static_cast<int64_t>(rng() % 30));  // a second root
  const int parents[] = {mid_a, mid_b, root, other};
  for (int q = 0; q < queries; ++q) t.add_query(t.add_node(parents[rng() % 4], 1 + static_cast<int64_t>(rng() % 5)));
  next_slot = static_cast<int32_t>(t.num_tokens());
  return t;
}

TEST(EnginePlanExtend, PatchedPlanComputesTheGrownTreesAttention) {
  const AttnShape shape{4, 2, 16};
  const int32_t num_slots = 400;
  const auto k = test::random_floats(static_cast<size_t>(num_slots) * 2 * 16, 1);
  const auto v = test::random_floats(static_cast<size_t>(num_slots) * 2 * 16, 2);
  for (int variant = 0; variant < 4; ++variant) {
    SCOPED_TRACE(variant);
    PlannerConfig cfg = engine_planner_config();
    if (variant == 1) cfg = splitting_planner();
    if (variant == 2) cfg.edges = EdgePolicy::kAllZero;
    if (variant == 3) {  // folded leaves everywhere: such plans are re-planned, never patched
      cfg.fold_min_rows = 0;
      cfg.fold_min_waves = 0;
      cfg.gamma = 0.1;  // cheap partial rows: the leaves stay vnodes of their own, which fold
    }
    Planner planner(cfg);
    int32_t next = 0;
    KvTree tree = batch_tree(6, 40 + variant, next);
    Plan plan;
    planner.build(tree, shape, plan);
    int extended = 0, replanned = 0, folded = 0;
    for (int step = 0; step < 30; ++step) {
      Vec slots(6);
      for (auto& s : slots) s = next++;
      grow_query_leaves(tree, slots);
      if (extend_plan(plan, tree, cfg)) {
        ++extended;
      } else {
        planner.build(tree, shape, plan);
        ++replanned;
      }
      validate_plan(plan, tree);
      folded += plan.privates.empty() ? 0 : 1;
      for (size_t i = 1; i < plan.items.size(); ++i) ASSERT_GE(item_tokens(plan.items[i - 1]), item_tokens(plan.items[i]));
      const auto q = test::random_floats(static_cast<size_t>(6 * 4 * 16), 100 + step);
      std::vector<float> got(q.size()), want(q.size());
      execute_plan(plan, tree, shape, q, k, v, 0.25f, got, {}, kThreads);
      reference_attention(tree, shape, q, k, v, 0.25f, want, {}, kThreads);
      ASSERT_LE(test::rel_err(got, want), 1e-5) << "step " << step;
    }
    if (variant == 3) {
      EXPECT_EQ(folded, 30);
      EXPECT_EQ(extended, 0);
      continue;
    }
    EXPECT_EQ(folded, 0);
    EXPECT_GT(extended, 0);
    if (variant == 1) {
      EXPECT_GT(replanned, 0);  // chunks of the split plan outgrow their siblings
      EXPECT_GT(plan.num_items(), plan.num_vnodes());
    }
    if (variant != 1) EXPECT_EQ(replanned, 0);
  }
}

// The merge that re-sorts a patched plan's items (no temporary buffer) orders them exactly as a
// stable sort by length would; the scratch kept between steps changes nothing either.
TEST(EnginePlanExtend, ReSortEqualsAStableSortAndScratchChangesNothing) {
  const AttnShape shape{4, 2, 16};
  PlannerConfig cfg = engine_planner_config();
  cfg.split = false;  // every step extends
  Planner planner(cfg);
  int32_t next = 0;
  KvTree tree = batch_tree(9, 77, next);
  KvTree tree2 = tree;
  Plan plan, plan2;
  planner.build(tree, shape, plan);
  plan2 = plan;
  PlanExtendScratch scratch;
  auto key = [](const PlanItem& it) { return std::tuple(it.vnode, it.kv_begin, it.q_begin, it.q_count, it.out_row); };
  for (int step = 0; step < 25; ++step) {
    Vec slots(9);
    for (auto& x : slots) x = next++;
    const std::vector<PlanItem> before = plan.items;
    grow_query_leaves(tree, slots, &scratch);
    grow_query_leaves(tree2, slots);
    ASSERT_EQ(tree.slots, tree2.slots);
    ASSERT_EQ(tree.slot_begin, tree2.slot_begin);
    ASSERT_TRUE(extend_plan(plan, tree, cfg, &scratch));
    ASSERT_TRUE(extend_plan(plan2, tree2, cfg));
    // Expected: the old order with the new lengths, stable-sorted longest first.
    std::map<std::tuple<int32_t, int32_t, int32_t, int32_t, int32_t>, int32_t> len;
    for (const PlanItem& it : plan.items) len[key(it)] = it.kv_len;
    std::vector<PlanItem> want = before;
    for (PlanItem& it : want) {
      ASSERT_TRUE(len.count(key(it)));
      ASSERT_TRUE(len[key(it)] == it.kv_len || len[key(it)] == it.kv_len + 1);
      it.kv_len = len[key(it)];
    }
    std::stable_sort(want.begin(), want.end(), [](const PlanItem& a, const PlanItem& b) { return a.kv_len > b.kv_len; });
    ASSERT_EQ(want.size(), plan.items.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(key(want[i]), key(plan.items[i])) << "step " << step << " item " << i;
      ASSERT_EQ(want[i].kv_len, plan.items[i].kv_len);
      ASSERT_EQ(key(plan2.items[i]), key(plan.items[i]));
    }
    ASSERT_EQ(plan.segments.size(), plan2.segments.size());
    for (size_t i = 0; i < plan.segments.size(); ++i) {
      ASSERT_EQ(plan.segments[i].slot_offset, plan2.segments[i].slot_offset);
      ASSERT_EQ(plan.segments[i].len, plan2.segments[i].len);
    }
    validate_plan(plan, tree);
  }
  // A refused growth leaves the tree as it was (the scratch may hold anything).
  const KvTree kept = tree;
  expect_error([&] { grow_query_leaves(tree, Vec{1, 2}, &scratch); }, {"2 new slots for 9 queries"});
  EXPECT_EQ(tree.slots, kept.slots);
  EXPECT_EQ(tree.slot_begin, kept.slot_begin);
}

TEST(EnginePlanExtend, RefusesWhatItCannotPatch) {
  const AttnShape shape{4, 2, 16};
  Planner planner;
  // A query whose leaf was empty has no segment to grow: re-plan.
  KvTree t;
  const int root = t.add_node(-1, 5);
  t.add_query(t.add_node(root, std::span<const int32_t>()));
  Plan plan;
  planner.build(t, shape, plan);
  grow_query_leaves(t, Vec{5});
  EXPECT_FALSE(extend_plan(plan, t, planner.config()));
  // A single chunk may grow up to the planner's chunk target (min_chunk here), not beyond.
  PlannerConfig cfg = engine_planner_config();
  cfg.min_chunk = 9;
  Planner small(cfg);
  KvTree t2;
  t2.add_query(t2.add_node(-1, 8));
  small.build(t2, shape, plan);
  grow_query_leaves(t2, Vec{8});
  EXPECT_TRUE(extend_plan(plan, t2, cfg));
  EXPECT_EQ(plan.vnode_len[0], 9);
  grow_query_leaves(t2, Vec{9});
  EXPECT_FALSE(extend_plan(plan, t2, cfg));
  // Without splitting nothing limits the growth.
  cfg.split = false;
  Planner nosplit(cfg);
  nosplit.build(t2, shape, plan);
  for (int32_t s = 10; s < 40; ++s) {
    grow_query_leaves(t2, Vec{s});
    ASSERT_TRUE(extend_plan(plan, t2, cfg));
  }
  validate_plan(plan, t2);
  // A plan of another tree.
  KvTree t3;
  t3.add_query(t3.add_node(-1, 4));
  t3.add_query(t3.add_node(-1, 4));
  planner.build(t3, shape, plan);
  grow_query_leaves(t2, Vec{40});
  EXPECT_FALSE(extend_plan(plan, t2, planner.config()));

  // grow_query_leaves needs one query per leaf.
  KvTree shared;
  const int n0 = shared.add_node(-1, 3);
  shared.add_query(n0);
  shared.add_query(n0);
  expect_error([&] { grow_query_leaves(shared, Vec{3, 4}); }, {"share node 0"});
  KvTree inner;
  const int a = inner.add_node(-1, 3);
  inner.add_node(a, 2);
  inner.add_query(a);
  expect_error([&] { grow_query_leaves(inner, Vec{9}); }, {"not a leaf"});
  expect_error([&] { grow_query_leaves(inner, Vec{9, 10}); }, {"2 new slots for 1 queries"});
}

}  // namespace
}  // namespace fasttree
