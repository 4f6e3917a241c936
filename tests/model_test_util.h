// Helpers shared by the GPU model tests (tests/test_engine_gpu.cpp, tests/test_engine_tp_gpu.cpp):
// token-id vectors, logit-row statistics and the small test model shapes.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/scheduler.h"

namespace fasttree::test {

using Vec = std::vector<int32_t>;

inline Vec iota(int32_t first, int32_t n) {
  Vec v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

inline Vec random_tokens(int n, uint64_t seed, int vocab) {
  std::mt19937_64 rng(seed);
  Vec t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

inline Vec concat(Vec a, const Vec& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// max(1, max |x|) of a logit row: the scale of the relative tolerances.
inline double row_scale(std::span<const float> ref) {
  double s = 1.0;
  for (float v : ref) s = std::max(s, std::abs(static_cast<double>(v)));
  return s;
}

// Top-1 minus top-2 of a row.
inline double top2_gap(std::span<const float> row) {
  float a = -INFINITY, b = -INFINITY;
  for (float v : row) {
    if (v > a) {
      b = a;
      a = v;
    } else if (v > b) {
      b = v;
    }
  }
  return static_cast<double>(a) - b;
}

// An unpadded head_dim-64 Llama with q/k/v/o biases (GQA 2, untied) ...
inline ModelConfig llama_bias64() {
  ModelConfig c = model_preset("tiny");
  c.hidden_size = 128;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.intermediate_size = 256;
  c.vocab_size = 320;
  c.attention_bias = true;
  return c;
}

// ... and a Qwen2 of the same size with one kv head (GQA 4) and tied embeddings.
inline ModelConfig qwen64() {
  ModelConfig c = llama_bias64();
  c.model_type = "qwen2";
  c.num_key_value_heads = 1;
  c.tie_word_embeddings = true;
  return c;
}

// Runs the requests through a Scheduler over `m` (checking its invariants after every step);
// results in submission order.
inline std::vector<GenerationResult> run_scheduler(DecoderModel& m, const std::vector<GenerationRequest>& reqs,
                                                   PathSharing sharing) {
  SchedulerOptions o;
  o.sharing = sharing;
  Scheduler s(m, o);
  for (const auto& r : reqs) s.submit(r);
  while (s.step()) s.check_invariants();
  auto out = s.take_finished();
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.id < y.id; });
  return out;
}

}  // namespace fasttree::test
