// Sampler (engine/sampler.h): greedy tie rule, determinism per seed, temperature, top-k and top-p
// restrictions, the empirical distribution, and bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "engine/sampler.h"
#include "engine_test_util.h"

namespace fasttree {
namespace {

using test::expect_error;
using test::random_floats;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::vector<double> softmax(const std::vector<float>& x, double t, const std::vector<int>& keep) {
  std::vector<double> p(x.size(), 0.0);
  double m = -1e300, s = 0;
  for (int i : keep) m = std::max(m, x[i] / t);
  for (int i : keep) s += std::exp(x[i] / t - m);
  for (int i : keep) p[i] = std::exp(x[i] / t - m) / s;
  return p;
}

TEST(EngineSampler, GreedyLowestIndexOnTies) {
  EXPECT_EQ(greedy_token(std::vector<float>{0.1f, 2.0f, -1.0f, 2.0f}), 1);
  EXPECT_EQ(greedy_token(std::vector<float>{kNegInf, kNegInf, -5.0f}), 2);
  EXPECT_EQ(greedy_token(std::vector<float>{3.0f}), 0);
  const auto logits = random_floats(1000, 3);
  int32_t best = 0;
  for (int i = 1; i < 1000; ++i)
    if (logits[i] > logits[best]) best = i;
  EXPECT_EQ(greedy_token(logits), best);
  // temperature 0 is greedy whatever else is set
  Sampler s({0.0f, 5, 0.3f, 9});
  EXPECT_EQ(s.sample(std::vector<float>{0.1f, 2.0f, -1.0f, 2.0f}), 1);
  EXPECT_EQ(s.probabilities(std::vector<float>{0.1f, 2.0f, -1.0f, 2.0f}), (std::vector<double>{0, 1, 0, 0}));
}

TEST(EngineSampler, DeterministicPerSeed) {
  const auto logits = random_floats(64, 4, -2.0f, 2.0f);
  const SamplingParams p{1.0f, 0, 1.0f, 1234};
  Sampler a(p), b(p), c({1.0f, 0, 1.0f, 1235});
  std::vector<int32_t> ta, tb, tc;
  for (int i = 0; i < 200; ++i) {
    ta.push_back(a.sample(logits));
    tb.push_back(b.sample(logits));
    tc.push_back(c.sample(logits));
  }
  EXPECT_EQ(ta, tb);
  EXPECT_NE(ta, tc);
  EXPECT_GT(std::set<int32_t>(ta.begin(), ta.end()).size(), 10u);  // it really samples
}

TEST(EngineSampler, TemperatureTopKTopP) {
  const std::vector<float> logits = {1.0f, 3.0f, 0.5f, 2.5f, -1.0f, 2.0f, kNegInf, 0.0f};
  // Temperature only: softmax(logits / T) over every finite token.
  for (float t : {0.5f, 1.0f, 2.0f}) {
    Sampler s({t, 0, 1.0f, 1});
    const auto p = s.probabilities(logits);
    const auto e = softmax(logits, t, {0, 1, 2, 3, 4, 5, 7});
    for (size_t i = 0; i < logits.size(); ++i) EXPECT_NEAR(p[i], e[i], 1e-12) << t << " " << i;
  }
  // Top-k = 3 keeps tokens 1, 3, 5 (logits 3, 2.5, 2), renormalized.
  {
    Sampler s({0.7f, 3, 1.0f, 2});
    const auto p = s.probabilities(logits);
    const auto e = softmax(logits, 0.7f, {1, 3, 5});
    for (size_t i = 0; i < logits.size(); ++i) EXPECT_NEAR(p[i], e[i], 1e-12) << i;
    for (int i = 0; i < 500; ++i) {
      const int32_t tok = s.sample(logits);
      EXPECT_TRUE(tok == 1 || tok == 3 || tok == 5) << tok;
    }
  }
  // Top-k ties at the k-th value: lower ids win.
  {
    Sampler s({1.0f, 2, 1.0f, 3});
    const auto p = s.probabilities(std::vector<float>{1.0f, 2.0f, 2.0f, 2.0f, 0.0f});
    EXPECT_NEAR(p[1], 0.5, 1e-12);
    EXPECT_NEAR(p[2], 0.5, 1e-12);
    EXPECT_EQ(p[3], 0.0);
  }
  // Top-p on probabilities 0.5, 0.3, 0.15, 0.05: keep while the mass before a token is < top_p.
  const std::vector<float> lp = {std::log(0.15f), std::log(0.5f), std::log(0.05f), std::log(0.3f)};
  auto kept = [&](float top_p, int top_k = 0) {
    Sampler s({1.0f, top_k, top_p, 4});
    std::set<int> out;
    const auto p = s.probabilities(lp);
    for (int i = 0; i < 4; ++i)
      if (p[i] > 0) out.insert(i);
    double sum = 0;
    for (double x : p) sum += x;
    EXPECT_NEAR(sum, 1.0, 1e-12);
    for (int i = 0; i < 300; ++i) EXPECT_TRUE(out.count(s.sample(lp))) << top_p;
    return out;
  };
  EXPECT_EQ(kept(0.45f), (std::set<int>{1}));
  EXPECT_EQ(kept(0.7f), (std::set<int>{1, 3}));
  EXPECT_EQ(kept(0.85f), (std::set<int>{0, 1, 3}));
  EXPECT_EQ(kept(1.0f), (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(kept(0.99f), (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(kept(0.85f, 2), (std::set<int>{1, 3}));  // top-k first, then top-p on the renormalized rest
  {
    Sampler s({1.0f, 0, 0.7f, 5});
    const auto p = s.probabilities(lp);
    EXPECT_NEAR(p[1], 0.5 / 0.8, 1e-6);
    EXPECT_NEAR(p[3], 0.3 / 0.8, 1e-6);
  }
}

TEST(EngineSampler, EmpiricalDistribution) {
  const std::vector<float> logits = {0.0f, 1.0f, 2.0f, -0.5f};
  Sampler s({1.0f, 0, 1.0f, 77});
  const auto e = softmax(logits, 1.0, {0, 1, 2, 3});
  std::vector<int> count(4, 0);
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++count[s.sample(logits)];
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(count[i] / static_cast<double>(n), e[i], 0.015) << i;
}

TEST(EngineSampler, BadInputs) {
  expect_error([] { Sampler s({-1.0f, 0, 1.0f, 0}); }, {"temperature"});
  expect_error([] { Sampler s({1.0f, -2, 1.0f, 0}); }, {"top_k"});
  expect_error([] { Sampler s({1.0f, 0, 0.0f, 0}); }, {"top_p"});
  expect_error([] { Sampler s({1.0f, 0, 1.5f, 0}); }, {"top_p"});
  expect_error([] { greedy_token(std::vector<float>{}); }, {"empty logits"});
  expect_error([] { greedy_token(std::vector<float>{1.0f, std::nanf("")}); }, {"logit 1"});
  expect_error([] { greedy_token(std::vector<float>{kNegInf, kNegInf}); }, {"every logit is -inf"});
  Sampler s({1.0f, 0, 1.0f, 0});
  expect_error([&] { s.sample(std::vector<float>{0.0f, std::numeric_limits<float>::infinity()}); }, {"logit 1"});
}

}  // namespace
}  // namespace fasttree
