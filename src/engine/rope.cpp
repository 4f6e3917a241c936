#include "engine/rope.h"

#include <cmath>
#include <string>

#include "core/error.h"

namespace fasttree {

std::vector<float> rope_inv_freq(int head_dim, double theta, const RopeScaling& scaling) {
  FT_CHECK(head_dim > 0 && head_dim % 2 == 0, "RoPE: head_dim " + std::to_string(head_dim) + " must be even and positive");
  FT_CHECK(theta > 0, "RoPE: theta must be positive, got " + std::to_string(theta));
  const int half = head_dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  const float base = static_cast<float>(theta);
  for (int i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    const float power = static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(exponent)));
    inv[i] = 1.0f / power;
  }
  if (scaling.type == RopeScalingType::kNone) return inv;

  const float factor = static_cast<float>(scaling.factor);
  const float low_ff = static_cast<float>(scaling.low_freq_factor);
  const float high_ff = static_cast<float>(scaling.high_freq_factor);
  FT_CHECK(factor > 0 && high_ff > low_ff && low_ff > 0 && scaling.original_max_position_embeddings > 0,
           "RoPE: invalid llama3 scaling (factor " + std::to_string(scaling.factor) + ", low/high freq factors " +
               std::to_string(scaling.low_freq_factor) + "/" + std::to_string(scaling.high_freq_factor) + ")");
  const float old_len = static_cast<float>(scaling.original_max_position_embeddings);
  // HF: low_freq_wavelen = old_context_len / low_freq_factor (python floats, then compared in fp32).
  const float low_wavelen = static_cast<float>(static_cast<double>(scaling.original_max_position_embeddings) /
                                               scaling.low_freq_factor);
  const float high_wavelen = static_cast<float>(static_cast<double>(scaling.original_max_position_embeddings) /
                                                scaling.high_freq_factor);
  const float two_pi = static_cast<float>(2.0 * M_PI);
  for (int i = 0; i < half; ++i) {
    const float f = inv[i];
    const float wavelen = two_pi / f;
    if (wavelen < high_wavelen) continue;  // high frequency: unchanged
    if (wavelen > low_wavelen) {           // low frequency: scaled down
      inv[i] = f / factor;
      continue;
    }
    const float smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff);
    inv[i] = (1.0f - smooth) * f / factor + smooth * f;
  }
  return inv;
}

Rope::Rope(int head_dim, double theta, const RopeScaling& scaling)
    : head_dim_(head_dim), inv_freq_(rope_inv_freq(head_dim, theta, scaling)) {}

Rope::Rope(const ModelConfig& config) : Rope(config.head_dim, config.rope_theta, config.rope_scaling) {}

void Rope::cos_sin(int64_t position, std::span<float> cos, std::span<float> sin) const {
  const size_t half = inv_freq_.size();
  FT_CHECK(cos.size() == half && sin.size() == half,
           "RoPE: cos/sin spans must hold head_dim/2 = " + std::to_string(half) + " floats");
  FT_CHECK(position >= 0, "RoPE: negative position " + std::to_string(position));
  const float p = static_cast<float>(position);
  for (size_t i = 0; i < half; ++i) {
    const float angle = inv_freq_[i] * p;  // fp32 product, as HF's inv_freq @ position_ids
    cos[i] = static_cast<float>(std::cos(static_cast<double>(angle)));
    sin[i] = static_cast<float>(std::sin(static_cast<double>(angle)));
  }
}

void Rope::apply(std::span<float> x, int num_heads, int64_t position) const {
  FT_CHECK(num_heads >= 0 && x.size() == static_cast<size_t>(num_heads) * static_cast<size_t>(head_dim_),
           "RoPE: x holds " + std::to_string(x.size()) + " floats, expected num_heads*head_dim = " +
               std::to_string(num_heads) + "*" + std::to_string(head_dim_));
  const int half = head_dim_ / 2;
  float cs[512], sn[512];
  std::vector<float> heap;
  float* c = cs;
  float* s = sn;
  if (half > 512) {
    heap.resize(2 * static_cast<size_t>(half));
    c = heap.data();
    s = heap.data() + half;
  }
  cos_sin(position, {c, static_cast<size_t>(half)}, {s, static_cast<size_t>(half)});
  for (int h = 0; h < num_heads; ++h) {
    float* row = x.data() + static_cast<size_t>(h) * head_dim_;
    for (int i = 0; i < half; ++i) {
      const float x1 = row[i];
      const float x2 = row[i + half];
      row[i] = x1 * c[i] - x2 * s[i];
      row[i + half] = x2 * c[i] + x1 * s[i];
    }
  }
}

}  // namespace fasttree
