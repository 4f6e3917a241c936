#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "core/error.h"

namespace fasttree {

namespace {

void check_logits(std::span<const float> logits) {
  FT_CHECK(!logits.empty(), "sampler: empty logits");
  bool any_finite = false;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float x = logits[i];
    FT_CHECK(!std::isnan(x) && x != INFINITY, "sampler: logit " + std::to_string(i) + " is " + std::to_string(x));
    any_finite = any_finite || std::isfinite(x);
  }
  FT_CHECK(any_finite, "sampler: every logit is -inf");
}

}  // namespace

void SamplingParams::validate() const {
  FT_CHECK(temperature >= 0.0f && std::isfinite(temperature),
           "sampling: temperature must be >= 0, got " + std::to_string(temperature));
  FT_CHECK(top_k >= 0, "sampling: top_k must be >= 0 (0 = off), got " + std::to_string(top_k));
  FT_CHECK(top_p > 0.0f && top_p <= 1.0f, "sampling: top_p must be in (0, 1], got " + std::to_string(top_p));
}

int32_t greedy_token(std::span<const float> logits) {
  check_logits(logits);
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return static_cast<int32_t>(best);
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) { params_.validate(); }

void Sampler::keep(std::span<const float> logits) {
  check_logits(logits);
  const size_t v = logits.size();
  const double inv_t = 1.0 / static_cast<double>(params_.temperature);
  order_.resize(v);
  std::iota(order_.begin(), order_.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
  size_t k = v;
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < v) {
    k = static_cast<size_t>(params_.top_k);
    std::partial_sort(order_.begin(), order_.begin() + static_cast<std::ptrdiff_t>(k), order_.end(), by_logit);
  } else {
    std::sort(order_.begin(), order_.end(), by_logit);
  }
  // Softmax over the top-k candidates (temperature applied), max-subtracted, in double.
  const double m = static_cast<double>(logits[order_[0]]) * inv_t;
  kept_.clear();
  double sum = 0.0;
  for (size_t i = 0; i < k; ++i) {
    const double p = std::exp(static_cast<double>(logits[order_[i]]) * inv_t - m);
    if (p == 0.0 && i > 0) break;  // -inf logits (and underflow) carry no mass
    kept_.emplace_back(order_[i], p);
    sum += p;
  }
  for (auto& e : kept_) e.second /= sum;
  // Top-p: keep tokens while the mass before them is below top_p.
  if (params_.top_p < 1.0f) {
    double before = 0.0;
    size_t n = 0;
    while (n < kept_.size() && before < static_cast<double>(params_.top_p)) before += kept_[n++].second;
    kept_.resize(std::max<size_t>(n, 1));
    double s = 0.0;
    for (const auto& e : kept_) s += e.second;
    for (auto& e : kept_) e.second /= s;
  }
}

std::vector<double> Sampler::probabilities(std::span<const float> logits) {
  std::vector<double> p(logits.size(), 0.0);
  if (params_.temperature == 0.0f) {
    p[static_cast<size_t>(greedy_token(logits))] = 1.0;
    return p;
  }
  keep(logits);
  for (const auto& [tok, prob] : kept_) p[static_cast<size_t>(tok)] = prob;
  return p;
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (params_.temperature == 0.0f) return greedy_token(logits);
  keep(logits);
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;  // [0, 1)
  double acc = 0.0;
  for (const auto& [tok, prob] : kept_) {
    acc += prob;
    if (u < acc) return tok;
  }
  return kept_.back().first;  // u within rounding of 1
}

}  // namespace fasttree
