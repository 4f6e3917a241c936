// Token sampling from fp32 logits [vocab].
//
//   greedy: argmax; on exact ties the lowest token id wins (deterministic, matches torch.argmax's
//           first-occurrence rule on CPU).
//   temperature > 0: HF order of warpers -> logits / temperature, then top-k (keep the k largest;
//           ties at the k-th value broken by lower id), then top-p (keep the smallest set of most
//           probable tokens whose probability sums to >= top_p; at least one token), then draw from
//           the softmax of the kept logits with the request's own std::mt19937_64 stream.
//   temperature == 0 means greedy whatever top_k / top_p say.
// Sampling is deterministic for a seed: each request owns a Sampler seeded once, so its tokens
// do not depend on which other requests share its batch. NaN or +inf logits, all logits -inf,
// temperature < 0, top_k < 0 and top_p outside (0, 1] are fasttree::Errors.
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace fasttree {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy
  int top_k = 0;             // 0 = off
  float top_p = 1.0f;        // 1 = off
  uint64_t seed = 0;
  void validate() const;
};

// Index of the largest logit, lowest index on exact ties.
int32_t greedy_token(std::span<const float> logits);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  const SamplingParams& params() const { return params_; }
  int32_t sample(std::span<const float> logits);
  // The probabilities sample() draws from (0 for excluded tokens), [vocab]; for tests and tools.
  std::vector<double> probabilities(std::span<const float> logits);

 private:
  // Fills kept_ with (token, probability), most probable first, probabilities summing to 1.
  void keep(std::span<const float> logits);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;
  std::vector<std::pair<int32_t, double>> kept_;
};

}  // namespace fasttree
