// Rotary position embedding, exactly as HF transformers computes it for Llama-family models.
//
// Inverse frequencies (float32, like HF's _compute_default_rope_parameters):
//   inv_freq[i] = 1 / theta^(float(2i) / d),  i in [0, d/2)
// Llama-3 scaling (HF _compute_llama3_parameters, float32, same operation order), with
// wavelen = 2π / inv_freq, low = orig_max_pos / low_freq_factor, high = orig_max_pos / high_freq_factor:
//   wavelen < high            -> inv_freq                     (high frequencies unchanged)
//   wavelen > low             -> inv_freq / factor            (low frequencies scaled down)
//   otherwise                 -> (1 - s) * inv_freq / factor + s * inv_freq,
//                                s = (orig_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
// Application at position p (HF rotate_half on the halves [x1, x2] of each head), with
// angle[i] = float(inv_freq[i] * p), c = cos(angle), s = sin(angle), i < d/2:
//   out[i]       = x[i] * c - x[i + d/2] * s
//   out[i + d/2] = x[i + d/2] * c + x[i] * s
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "engine/model_config.h"

namespace fasttree {

// [head_dim / 2] inverse frequencies; head_dim must be even and positive, theta positive.
std::vector<float> rope_inv_freq(int head_dim, double theta, const RopeScaling& scaling);

class Rope {
 public:
  Rope(int head_dim, double theta, const RopeScaling& scaling);
  explicit Rope(const ModelConfig& config);

  int head_dim() const { return head_dim_; }
  std::span<const float> inv_freq() const { return inv_freq_; }
  // cos / sin of every frequency at `position`, each [head_dim / 2].
  void cos_sin(int64_t position, std::span<float> cos, std::span<float> sin) const;
  // Rotates x [num_heads, head_dim] in place for `position` (>= 0).
  void apply(std::span<float> x, int num_heads, int64_t position) const;

 private:
  int head_dim_;
  std::vector<float> inv_freq_;
};

}  // namespace fasttree
