// CPU building blocks of the engine: RoPE (engine/rope.h) against hand-written formulas, including
// Llama-3 frequency scaling; RMSNorm, linear, SwiGLU (engine/cpu_ops.h); and the slot-path ->
// KvTree builder (engine/slot_paths.h).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/kv_tree.h"
#include "engine/cpu_ops.h"
#include "engine/rope.h"
#include "engine/slot_paths.h"
#include "engine_test_util.h"

namespace fasttree {
namespace {

using test::expect_error;
using test::random_floats;

// Hand-written inverse frequency in double (HF formulas, no float rounding).
double hand_inv_freq(int i, int d, double theta, const RopeScaling& s) {
  const double f = std::pow(theta, -2.0 * i / d);
  if (s.type == RopeScalingType::kNone) return f;
  const double orig = static_cast<double>(s.original_max_position_embeddings);
  const double wavelen = 2.0 * M_PI / f;
  if (wavelen < orig / s.high_freq_factor) return f;
  if (wavelen > orig / s.low_freq_factor) return f / s.factor;
  const double smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return (1.0 - smooth) * f / s.factor + smooth * f;
}

TEST(EngineRope, InverseFrequenciesPlain) {
  for (double theta : {10000.0, 1000000.0}) {
    const auto inv = rope_inv_freq(128, theta, {});
    ASSERT_EQ(inv.size(), 64u);
    EXPECT_EQ(inv[0], 1.0f);
    for (int i = 0; i < 64; ++i) EXPECT_NEAR(inv[i], hand_inv_freq(i, 128, theta, {}), 1e-6 * inv[i]) << i;
  }
  // A value by hand: theta 10000, d 16, i = 4 -> 10000^(-0.5) = 0.01.
  EXPECT_NEAR(rope_inv_freq(16, 10000.0, {})[4], 0.01f, 1e-9);
}

TEST(EngineRope, Llama3ScalingMatchesHf) {
  const ModelConfig c = model_preset("llama3-8b");
  const auto inv = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling);
  ASSERT_EQ(inv.size(), 64u);
  int high = 0, low = 0, medium = 0;
  for (int i = 0; i < 64; ++i) {
    const double plain = std::pow(c.rope_theta, -2.0 * i / 128);
    const double wavelen = 2.0 * M_PI / plain;
    const double expect = hand_inv_freq(i, 128, c.rope_theta, c.rope_scaling);
    EXPECT_NEAR(inv[i], expect, 2e-6 * expect) << "i=" << i;
    if (wavelen < 2048.0) {
      ++high;
      EXPECT_NEAR(inv[i], plain, 1e-6 * plain);
    } else if (wavelen > 8192.0) {
      ++low;
      EXPECT_NEAR(inv[i], plain / 8.0, 1e-6 * plain / 8.0);
    } else {
      ++medium;
      EXPECT_LT(inv[i], plain);
      EXPECT_GT(inv[i], plain / 8.0);
    }
  }
  // Llama-3.1-8B: wavelen 2π·500000^(i/64) crosses 2048 after i = 28 and 8192 after i = 34.
  EXPECT_EQ(high, 29);
  EXPECT_EQ(medium, 6);
  EXPECT_EQ(low, 29);
  // Spot values: i = 0 untouched; i = 63 scaled by 1/8.
  EXPECT_EQ(inv[0], 1.0f);
  EXPECT_NEAR(inv[63], std::pow(500000.0, -126.0 / 128) / 8.0, 1e-6 * inv[63]);
  // One medium frequency by hand: i = 32, f = 500000^(-64/128), wavelen = 2π/f ≈ 4443.
  const double f32 = std::pow(500000.0, -64.0 / 128);
  const double w32 = 2.0 * M_PI / f32;
  ASSERT_TRUE(w32 > 2048.0 && w32 < 8192.0) << w32;
  const double s32 = (8192.0 / w32 - 1.0) / 3.0;
  EXPECT_NEAR(inv[32], (1.0 - s32) * f32 / 8.0 + s32 * f32, 2e-6 * f32);
}

TEST(EngineRope, ApplyRotatesHalves) {
  const int heads = 3, d = 16;
  RopeScaling s{RopeScalingType::kLlama3, 4.0, 1.0, 4.0, 32};  // small context: every regime at d = 16
  for (const RopeScaling& scaling : {RopeScaling{}, s}) {
    const Rope rope(d, 10000.0, scaling);
    for (int64_t pos : {0, 1, 7, 1000}) {
      auto x = random_floats(heads * d, 100 + pos);
      const auto x0 = x;
      rope.apply(x, heads, pos);
      for (int h = 0; h < heads; ++h) {
        for (int i = 0; i < d / 2; ++i) {
          const float angle = rope.inv_freq()[i] * static_cast<float>(pos);
          const double c = std::cos(static_cast<double>(angle)), sn = std::sin(static_cast<double>(angle));
          const double x1 = x0[h * d + i], x2 = x0[h * d + i + d / 2];
          EXPECT_NEAR(x[h * d + i], x1 * c - x2 * sn, 1e-6) << pos << " " << i;
          EXPECT_NEAR(x[h * d + i + d / 2], x2 * c + x1 * sn, 1e-6) << pos << " " << i;
        }
      }
      if (pos == 0) {
        EXPECT_EQ(x, x0);
      }
    }
  }
  // Relative-position property: <rope(q, m), rope(k, n)> depends on m - n only.
  const Rope rope(d, 10000.0, {});
  const auto q = random_floats(d, 1), k = random_floats(d, 2);
  auto score = [&](int64_t m, int64_t n) {
    auto a = q, b = k;
    rope.apply(a, 1, m);
    rope.apply(b, 1, n);
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += static_cast<double>(a[i]) * b[i];
    return dot;
  };
  EXPECT_NEAR(score(5, 2), score(13, 10), 1e-5);
  EXPECT_NEAR(score(9, 9), score(0, 0), 1e-5);

  std::vector<float> bad(10);
  expect_error([&] { rope.apply(bad, 1, 0); }, {"RoPE", "num_heads*head_dim"});
  std::vector<float> ok(16);
  expect_error([&] { rope.apply(ok, 1, -1); }, {"negative position"});
  expect_error([] { rope_inv_freq(15, 10000.0, {}); }, {"head_dim 15"});
}

TEST(EngineOps, RmsNorm) {
  const int n = 3, dim = 24;
  const auto x = random_floats(n * dim, 5, -3.0f, 3.0f);
  const auto w = random_floats(dim, 6, 0.5f, 1.5f);
  std::vector<float> y(x.size());
  rms_norm(x, w, 1e-5f, y);
  for (int r = 0; r < n; ++r) {
    double ss = 0;
    for (int c = 0; c < dim; ++c) ss += static_cast<double>(x[r * dim + c]) * x[r * dim + c];
    const double inv = 1.0 / std::sqrt(ss / dim + 1e-5);
    for (int c = 0; c < dim; ++c) EXPECT_NEAR(y[r * dim + c], w[c] * x[r * dim + c] * inv, 1e-6);
  }
  auto inplace = x;
  rms_norm(inplace, w, 1e-5f, inplace);
  EXPECT_EQ(inplace, y);
  std::vector<float> wrong(5);
  expect_error([&] { rms_norm(x, wrong, 1e-5f, y); }, {"rms_norm", "multiple"});
  expect_error([&] { rms_norm(x, w, 1e-5f, wrong); }, {"rms_norm", "out has 5"});
}

TEST(EngineOps, LinearAndSwiGlu) {
  // Big enough for the parallel path (n*out*in >= 2^18).
  const int64_t n = 3, in = 301, out = 300;
  const auto x = random_floats(n * in, 8);
  const auto w = random_floats(out * in, 9);
  const auto b = random_floats(out, 10);
  for (int threads : {1, 2}) {
    std::vector<float> y(n * out);
    linear(x, n, w, out, in, b, y, threads);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t o = 0; o < out; ++o) {
        double acc = b[o];
        for (int64_t i = 0; i < in; ++i) acc += static_cast<double>(x[r * in + i]) * w[o * in + i];
        EXPECT_NEAR(y[r * out + o], acc, 2e-5) << r << " " << o;
      }
    }
  }
  std::vector<float> y(n * out);
  expect_error([&] { linear(x, n, w, out, in + 1, {}, y); }, {"linear", "x has"});
  expect_error([&] { linear(x, n, w, out, in, std::vector<float>(3), y); }, {"linear", "bias has 3"});
  std::vector<float> y2(2);
  expect_error([&] { linear(x, n, w, out, in, {}, y2); }, {"linear", "y has 2"});

  auto gate = random_floats(50, 11, -4.0f, 4.0f);
  const auto up = random_floats(50, 12);
  const auto g0 = gate;
  silu_mul(gate, up);
  for (size_t i = 0; i < gate.size(); ++i) EXPECT_NEAR(gate[i], g0[i] / (1.0 + std::exp(-g0[i])) * up[i], 1e-6);
  expect_error([&] { silu_mul(gate, std::vector<float>(3)); }, {"silu_mul"});
}

// Slots on query q's path, root -> node.
std::vector<int32_t> path_of(const KvTree& t, int q) {
  std::vector<int> nodes;
  for (int v = t.query_node[q]; v >= 0; v = t.parent[v]) nodes.push_back(v);
  std::vector<int32_t> out;
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    auto s = t.node_slots(*it);
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

TEST(EngineSlotPaths, SharedTrieAndPerRequest) {
  const std::vector<std::vector<int32_t>> paths = {
      {10, 11, 12, 13, 20, 21},  // shares 10..13 with the next two
      {10, 11, 12, 13, 30},
      {10, 11, 12, 13, 30, 31, 32},  // extends request 1's path: request 1 sits at an internal node
      {40, 41},                      // a second root
      {},                            // empty context
      {10, 11, 50},                  // branches inside the first node
  };
  const KvTree shared = kv_tree_from_paths(paths);
  validate_tree(shared);
  ASSERT_EQ(shared.num_queries(), 6);
  for (int q = 0; q < 6; ++q) EXPECT_EQ(path_of(shared, q), paths[q]) << q;
  // Tokens stored once: 10,11 | 12,13 | 20,21 | 30 | 31,32 | 40,41 | 50 (+ one empty root).
  EXPECT_EQ(shared.num_tokens(), 12);
  EXPECT_EQ(shared.num_nodes(), 8);
  EXPECT_EQ(shared.node_len(shared.query_node[4]), 0);
  EXPECT_EQ(shared.parent[shared.query_node[2]], shared.query_node[1]);

  const KvTree alone = kv_tree_from_paths(paths, PathSharing::kPerRequest);
  validate_tree(alone);
  EXPECT_EQ(alone.num_nodes(), 6);
  for (int q = 0; q < 6; ++q) {
    EXPECT_EQ(alone.parent[alone.query_node[q]], -1);
    EXPECT_EQ(path_of(alone, q), paths[q]);
  }
  // Identical paths share everything, each query still sees exactly its path.
  const std::vector<std::vector<int32_t>> same = {{1, 2, 3}, {1, 2, 3}};
  const KvTree t = kv_tree_from_paths(same);
  EXPECT_EQ(t.num_nodes(), 1);
  EXPECT_EQ(t.query_node, (std::vector<int32_t>{0, 0}));
}

}  // namespace
}  // namespace fasttree
