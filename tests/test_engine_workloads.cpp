// End-to-end workloads (engine/workloads.h): request counts and prompt lengths of A-D at full
// scale, the exact shared-prefix structure (checked against a RadixCache holding the prompts and
// by direct comparison), determinism from the seed, ids inside the vocabulary, scaling, the trie
// figures of workload_stats, and one-line errors for bad specs.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/radix_cache.h"
#include "core/slot_pool.h"
#include "engine/workloads.h"
#include "engine_test_util.h"

namespace fasttree {
namespace {

using test::expect_error;

WorkloadSpec spec(const std::string& name, double scale = 1.0, double length_scale = 1.0, uint64_t seed = 0) {
  WorkloadSpec s;
  s.name = name;
  s.vocab_size = 32000;
  s.seed = seed;
  s.scale = scale;
  s.length_scale = length_scale;
  return s;
}

int64_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  return std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin();
}

// Prompts inserted one by one into a RadixCache: how many tokens of each were already cached.
std::vector<int64_t> cached_lengths(const std::vector<GenerationRequest>& reqs) {
  int64_t total = 0;
  for (const auto& r : reqs) total += static_cast<int64_t>(r.prompt.size());
  SlotPool pool(static_cast<int32_t>(total));
  RadixCache cache(pool);
  std::vector<int64_t> out;
  for (const auto& r : reqs) {
    const RadixCache::MatchResult m = cache.match_prefix(r.prompt);
    out.push_back(m.length);
    std::vector<int32_t> slots = m.slots;
    const std::vector<int32_t> fresh = pool.alloc(static_cast<int64_t>(r.prompt.size()) - m.length);
    slots.insert(slots.end(), fresh.begin(), fresh.end());
    cache.insert(r.prompt, slots);
  }
  EXPECT_EQ(cache.total_tokens(), workload_stats(reqs).unique_prompt_tokens);
  return out;
}

TEST(Workloads, FullScaleCountsAndLengths) {
  struct Want {
    std::string name;
    int64_t requests, sequences, unique;
    int64_t min_prompt, max_prompt;
  };
  // A: 2048 + 4*1145 + 512*64; B: 512 + 8*1600 + 128*64; C: 1024 + 32*128 (n = 4);
  // D: 64 documents of 1050..1150 + 128*64 (checked by range below).
  for (const Want& w : {Want{"A", 512, 512, 2048 + 4 * 1145 + 512 * 64, 3257, 3257},
                        Want{"B", 128, 128, 512 + 8 * 1600 + 128 * 64, 2176, 2176},
                        Want{"C", 32, 128, 1024 + 32 * 128, 1152, 1152}}) {
    const auto reqs = make_workload(spec(w.name));
    const WorkloadStats s = workload_stats(reqs);
    EXPECT_EQ(s.requests, w.requests) << w.name;
    EXPECT_EQ(s.sequences, w.sequences) << w.name;
    EXPECT_EQ(s.unique_prompt_tokens, w.unique) << w.name;
    EXPECT_EQ(s.min_prompt, w.min_prompt) << w.name;
    EXPECT_EQ(s.max_prompt, w.max_prompt) << w.name;
    EXPECT_EQ(s.generated_tokens, w.sequences * 256) << w.name;
    EXPECT_EQ(s.kv_slots_all_at_once(), w.unique + w.sequences * 256) << w.name;
    for (const auto& r : reqs) {
      EXPECT_EQ(r.max_new_tokens, 256);
      EXPECT_EQ(r.n, w.name == "C" ? 4 : 1);
      EXPECT_EQ(r.sampling.temperature, 0.0f);
      EXPECT_TRUE(r.stop_tokens.empty());
    }
  }
  const auto d = make_workload(spec("D"));
  const WorkloadStats s = workload_stats(d);
  EXPECT_EQ(s.requests, 128);
  EXPECT_EQ(s.sequences, 128);
  EXPECT_GE(s.min_prompt, 4 * 1050 + 64);
  EXPECT_LE(s.max_prompt, 4 * 1150 + 64);
  EXPECT_GE(s.unique_prompt_tokens, 64 * 1050 + 128 * 64);
  EXPECT_LE(s.unique_prompt_tokens, 64 * 1150 + 128 * 64);
  EXPECT_NEAR(static_cast<double>(s.unique_prompt_tokens - 128 * 64) / 64.0, 1100.0, 25.0);  // ~1100 per document
  EXPECT_EQ(s.max_request_slots, s.max_prompt + 255);
}

TEST(Workloads, SharedPrefixStructureA) {
  const auto reqs = make_workload(spec("A"));
  // Direct comparison: same variant (block of 128) shares 3193 tokens, other variants 2048.
  for (size_t i = 1; i < reqs.size(); ++i) {
    const int64_t want = (i / 128 == (i - 1) / 128) ? 3193 : 2048;
    ASSERT_EQ(common_prefix(reqs[i - 1].prompt, reqs[i].prompt), want) << i;
  }
  EXPECT_EQ(common_prefix(reqs[0].prompt, reqs[511].prompt), 2048);
  // Radix cache: the first request caches nothing, a variant's first question the root prompt,
  // every other question its whole variant prefix.
  const auto cached = cached_lengths(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const int64_t want = i == 0 ? 0 : (i % 128 == 0 ? 2048 : 3193);
    ASSERT_EQ(cached[i], want) << i;
  }
}

TEST(Workloads, SharedPrefixStructureBCD) {
  {
    const auto reqs = make_workload(spec("B"));
    const auto cached = cached_lengths(reqs);
    for (size_t i = 1; i < reqs.size(); ++i) ASSERT_EQ(cached[i], i % 16 == 0 ? 512 : 512 + 1600) << i;
  }
  {
    const auto reqs = make_workload(spec("C"));
    const auto cached = cached_lengths(reqs);
    for (size_t i = 1; i < reqs.size(); ++i) ASSERT_EQ(cached[i], 1024) << i;
  }
  {
    const auto reqs = make_workload(spec("D"));
    const auto cached = cached_lengths(reqs);
    EXPECT_EQ(cached[0], 0);
    for (size_t i = 1; i < reqs.size(); ++i) {
      const int64_t docs = static_cast<int64_t>(reqs[i].prompt.size()) - 64;  // the branch's 4 documents
      ASSERT_EQ(cached[i], i % 8 == 0 ? 0 : docs) << i;  // branches share nothing (a forest of 16)
    }
  }
}

TEST(Workloads, DeterministicAndInsideTheVocabulary) {
  for (const std::string& name : workload_names()) {
    WorkloadSpec s = spec(name, 0.25, 0.1, 7);
    s.vocab_size = 300;
    const auto a = make_workload(s);
    const auto b = make_workload(s);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i].prompt, b[i].prompt) << name << " " << i;
    for (const auto& r : a)
      for (int32_t t : r.prompt) ASSERT_TRUE(t >= 0 && t < 300) << name;
    s.seed = 8;
    const auto c = make_workload(s);
    ASSERT_EQ(c.size(), a.size());
    EXPECT_NE(c[0].prompt, a[0].prompt) << name;
  }
}

TEST(Workloads, ScaleShrinksFanoutsAndLengths) {
  // small: fan-outs x 1/8 (at least 2), lengths x 1/16.
  const auto a = make_workload(spec("A", 0.125, 0.0625));
  EXPECT_EQ(a.size(), 2u * 16u);  // 4 -> 2 variants, 128 -> 16 questions
  EXPECT_EQ(a[0].prompt.size(), 128u + 72u + 4u);
  EXPECT_EQ(workload_stats(a).unique_prompt_tokens, 128 + 2 * 72 + 32 * 4);
  const auto c = make_workload(spec("C", 0.125, 0.0625));
  EXPECT_EQ(c.size(), 4u);
  EXPECT_EQ(c[0].n, 2);  // 4 chains -> 2
  const auto d = make_workload(spec("D", 0.125, 0.0625));
  EXPECT_EQ(d.size(), 2u * 2u);  // 16 -> 2 branches, 8 -> 2 questions; still 4 documents per branch
  const WorkloadShape shape = workload_shape(spec("D", 0.125, 0.0625));
  ASSERT_EQ(shape.levels.size(), 5u);
  EXPECT_EQ(shape.levels[1].fanout, 1);
  EXPECT_EQ(shape.levels[0].tokens, 69);
  EXPECT_EQ(shape.levels[0].jitter, 3);
  EXPECT_EQ(workload_shape(spec("A")).describe(), "1 x system prompt 2048 -> 4 x variant 1145 -> 128 x question 64");
  EXPECT_EQ(workload_shape(spec("C")).describe(), "1 x system prompt 1024 -> 32 x question 128 -> n 4");
  // Scale 1 is the full workload.
  EXPECT_EQ(make_workload(spec("B", 1.0)).size(), 128u);
  // A fan-out scaled to 1 still branches (at least 2).
  EXPECT_EQ(make_workload(spec("B", 0.01, 0.01)).size(), 4u);
}

TEST(Workloads, StatsOfArbitraryRequests) {
  std::vector<GenerationRequest> reqs(4);
  reqs[0].prompt = {1, 2, 3, 4};
  reqs[1].prompt = {1, 2, 5};
  reqs[2].prompt = {1, 2, 3, 4};  // duplicate: nothing new
  reqs[3].prompt = {9};
  reqs[3].n = 3;
  reqs[3].max_new_tokens = 10;
  const WorkloadStats s = workload_stats(reqs);
  EXPECT_EQ(s.requests, 4);
  EXPECT_EQ(s.sequences, 6);
  EXPECT_EQ(s.prompt_tokens, 12);
  EXPECT_EQ(s.unique_prompt_tokens, 6);  // 1 2 3 4, 5, 9
  EXPECT_EQ(s.min_prompt, 1);
  EXPECT_EQ(s.max_prompt, 4);
  EXPECT_EQ(s.generated_tokens, 3 * 16 + 30);
  EXPECT_EQ(s.max_request_slots, 1 + 3 * 9);
  EXPECT_DOUBLE_EQ(s.sharing(), 2.0);
  EXPECT_EQ(workload_stats({}).unique_prompt_tokens, 0);
}

TEST(Workloads, BadSpecsAreOneLineErrors) {
  expect_error([] { make_workload(spec("E")); }, {"unknown workload 'E'", "A, B, C, D"});
  expect_error([] { make_workload(spec("a")); }, {"unknown workload 'a'"});
  expect_error([] { make_workload(spec("A", 0.0)); }, {"workload A", "scale must be in (0, 1]"});
  expect_error([] { make_workload(spec("A", 1.5)); }, {"scale must be in (0, 1]"});
  expect_error([] { make_workload(spec("B", 1.0, 0.0)); }, {"length scale must be in (0, 1]"});
  expect_error([] { make_workload(spec("B", 1.0, 2.0)); }, {"length scale"});
  WorkloadSpec s = spec("A");
  s.vocab_size = 100;  // 128 questions per variant need 128 distinct first tokens
  expect_error([&] { make_workload(s); }, {"vocabulary of 100 tokens", "fan-out 128"});
  s.vocab_size = 32000;
  s.max_new_tokens = 0;
  expect_error([&] { make_workload(s); }, {"max_new_tokens must be >= 1"});
}

}  // namespace
}  // namespace fasttree
