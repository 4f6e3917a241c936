// Correctness of the CPU engine against an independent implementation: HuggingFace transformers.
//
// data/golden/<model>/ holds config.json + model.safetensors of a tiny random model and golden.json
// (made by scripts/make_golden.py on the GPU machine, fp32 CPU, eager attention): prompts, the fp32
// logits of each prompt's last position, 8 greedy tokens per prompt (model.generate) and the logits
// of every greedy step. Checks, per model:
//   * prefill logits of the last prompt position: max |engine - HF| <= 1e-4 * max(1, max |HF logit|);
//   * greedy decoding of 8 tokens through the FastTree decode path (planner + cpu executor), the
//     prompts of a model decoded together as one batch: token ids exactly equal, and the logits of
//     every step within the same tolerance;
//   * the same through the per-request tree (no sharing) and a lone request: identical tokens;
//   * the scheduler (engine/scheduler.h: continuous batching, prefix cache, plan extension, a
//     2-sample greedy fork) produces the same tokens.
// With no model folder in data/golden/ the tests skip, saying how to make the data.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/cpu_model.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/slot_paths.h"
#include "engine/weights.h"
#include "golden_util.h"

namespace fasttree {
namespace {

using test::Golden;
using test::golden_dirs;
using test::golden_root;
using test::load_golden;

constexpr double kRelTol = 1e-4;  // max abs diff <= kRelTol * max(1, max |golden logit|)



#define SKIP_WITHOUT_GOLDEN(dirs)                                                                            \
  if ((dirs).empty())                                                                                        \
  GTEST_SKIP() << "no golden data in " << golden_root()                                                       \
               << "/: generate it with `python3 scripts/make_golden.py --out OUTDIR` on the GPU machine "   \
                  "(torch + transformers) and copy OUTDIR/* into data/golden/"


// Largest max-abs-diff / max(1, max |logit|) seen, reported per test.
double g_worst = 0.0;

// Checks one logits row against the bound.
void expect_logits_near(std::span<const float> got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double diff = 0.0, scale = 1.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  g_worst = std::max(g_worst, diff / scale);
  EXPECT_LE(diff, kRelTol * scale) << what << ": max |engine - transformers| = " << diff << ", max |logit| = " << scale;
}

CpuModel load_model(const std::string& dir, int32_t num_slots) {
  const ModelConfig config = load_model_config(dir);
  const SafetensorsFolder folder(dir);
  return CpuModel(load_weights(folder, config), num_slots);
}

TEST(EngineGolden, PrefillLogitsMatchTransformers) {
  const auto dirs = golden_dirs();
  SKIP_WITHOUT_GOLDEN(dirs);
  g_worst = 0.0;
  for (const std::string& dir : dirs) {
    SCOPED_TRACE(dir);
    const Golden g = load_golden(dir);
    ASSERT_EQ(g.prompts.size(), g.logits_last.size());
    CpuModel model = load_model(dir, 64);
    for (size_t p = 0; p < g.prompts.size(); ++p) {
      const auto& prompt = g.prompts[p];
      std::vector<int32_t> pos(prompt.size()), slots(prompt.size());
      for (size_t i = 0; i < prompt.size(); ++i) pos[i] = slots[i] = static_cast<int32_t>(i);
      const std::vector<float> logits = model.prefill(prompt, pos, slots, {});
      expect_logits_near(logits, g.logits_last[p], "prompt " + std::to_string(p));
      EXPECT_EQ(greedy_token(logits), g.greedy[p][0]) << "prompt " << p;
    }
  }
  std::cout << "[ golden   ] " << dirs.size() << " models, worst max|diff| / max(1, max|logit|) = " << g_worst
            << " (tolerance " << kRelTol << ")\n";
}

// Greedy decoding of every prompt of a model, prompts batched together in each decode step.
std::vector<std::vector<int32_t>> greedy_batched(CpuModel& model, const Golden& g, PathSharing sharing,
                                                 bool check_logits) {
  const size_t np = g.prompts.size();
  const size_t steps = g.greedy.empty() ? 0 : g.greedy[0].size();
  std::vector<std::vector<int32_t>> paths(np), out(np);
  std::vector<int32_t> last(np);
  int32_t next_slot = 0;
  for (size_t p = 0; p < np; ++p) {
    const auto& prompt = g.prompts[p];
    std::vector<int32_t> pos(prompt.size()), slots(prompt.size());
    for (size_t i = 0; i < prompt.size(); ++i) {
      pos[i] = static_cast<int32_t>(i);
      slots[i] = next_slot++;
    }
    const std::vector<float> logits = model.prefill(prompt, pos, slots, {});
    last[p] = greedy_token(logits);
    out[p].push_back(last[p]);
    paths[p] = slots;
  }
  for (size_t step = 1; step < steps; ++step) {
    std::vector<int32_t> tokens(np), pos(np), slots(np);
    for (size_t p = 0; p < np; ++p) {
      tokens[p] = last[p];
      pos[p] = static_cast<int32_t>(paths[p].size());
      slots[p] = next_slot++;
      paths[p].push_back(slots[p]);
    }
    const KvTree tree = kv_tree_from_paths(paths, sharing);
    const std::vector<float> logits = model.decode({tokens, pos, slots, &tree}, DecodeAttention::kFastTree);
    const size_t V = static_cast<size_t>(model.config().vocab_size);
    for (size_t p = 0; p < np; ++p) {
      std::span<const float> row(logits.data() + p * V, V);
      if (check_logits && !g.greedy_logits.empty() && out[p] == std::vector<int32_t>(g.greedy[p].begin(), g.greedy[p].begin() + step))
        expect_logits_near(row, g.greedy_logits[p][step], "prompt " + std::to_string(p) + " step " + std::to_string(step));
      last[p] = greedy_token(row);
      out[p].push_back(last[p]);
    }
  }
  return out;
}

TEST(EngineGolden, GreedyDecodeFastTreeMatchesTransformers) {
  const auto dirs = golden_dirs();
  SKIP_WITHOUT_GOLDEN(dirs);
  g_worst = 0.0;
  for (const std::string& dir : dirs) {
    SCOPED_TRACE(dir);
    const Golden g = load_golden(dir);
    ASSERT_FALSE(g.greedy.empty());
    CpuModel model = load_model(dir, 256);
    const auto tokens = greedy_batched(model, g, PathSharing::kShared, true);
    for (size_t p = 0; p < g.prompts.size(); ++p) EXPECT_EQ(tokens[p], g.greedy[p]) << "prompt " << p;
    // Per-request trees give the same tokens.
    CpuModel model2 = load_model(dir, 256);
    EXPECT_EQ(greedy_batched(model2, g, PathSharing::kPerRequest, false), tokens);
  }
  std::cout << "[ golden   ] decode steps: worst max|diff| / max(1, max|logit|) = " << g_worst << " (tolerance "
            << kRelTol << ")\n";
}

TEST(EngineGolden, GreedyDecodeAloneMatchesTransformers) {
  const auto dirs = golden_dirs();
  SKIP_WITHOUT_GOLDEN(dirs);
  for (const std::string& dir : dirs) {
    SCOPED_TRACE(dir);
    Golden g = load_golden(dir);
    // Only the longest prompt, alone in its batch.
    Golden one = g;
    one.prompts = {g.prompts.back()};
    one.logits_last = {g.logits_last.back()};
    one.greedy = {g.greedy.back()};
    one.greedy_logits.clear();
    CpuModel model = load_model(dir, 64);
    EXPECT_EQ(greedy_batched(model, one, PathSharing::kShared, false)[0], g.greedy.back());
  }
}

TEST(EngineGolden, SchedulerMatchesTransformers) {
  const auto dirs = golden_dirs();
  SKIP_WITHOUT_GOLDEN(dirs);
  for (const std::string& dir : dirs) {
    SCOPED_TRACE(dir);
    const Golden g = load_golden(dir);
    CpuModel model = load_model(dir, 256);
    Scheduler s(model);
    for (size_t p = 0; p < g.prompts.size(); ++p) {
      GenerationRequest r;
      r.prompt = g.prompts[p];
      r.max_new_tokens = static_cast<int>(g.greedy[p].size());
      r.n = p == 0 ? 2 : 1;
      s.submit(r);
    }
    const auto results = s.run();
    ASSERT_EQ(results.size(), g.prompts.size());
    for (size_t p = 0; p < g.prompts.size(); ++p)
      for (const auto& sample : results[p].samples) EXPECT_EQ(sample, g.greedy[p]) << "prompt " << p;
    EXPECT_GT(s.stats().plan_extensions, 0);
  }
}

}  // namespace
}  // namespace fasttree
