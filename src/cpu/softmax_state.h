// SoftmaxState: fp32 online-softmax state of one attention row (like FlashInfer's state_t), over a
// caller-owned accumulator of head_dim floats.
//
//   m    running max of the scores seen so far (-inf while empty)
//   l    Σ exp(s - m)
//   acc  Σ exp(s - m) · v        (unnormalized)
//
// The row's output is acc / l and its natural-log LSE is m + log(l). A normalized partial result
// (o, lse) is the state (m = lse, l = 1, acc = o), so merging partials is merge(lse, 1, o).
// Every path guards -inf: an empty state (or an empty partial with lse = -inf) contributes nothing
// and never produces NaN; normalizing an empty state yields zeros and lse = -inf.
#pragma once
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>

namespace fasttree {

class SoftmaxState {
 public:
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  explicit SoftmaxState(std::span<float> acc) : acc_(acc) { reset(); }

  void reset() {
    m_ = kNegInf;
    l_ = 0.0f;
    for (float& a : acc_) a = 0.0f;
  }

  float m() const { return m_; }
  float l() const { return l_; }
  std::span<const float> acc() const { return acc_; }
  bool empty() const { return l_ == 0.0f; }

  // Adds a tile of scores (already scaled; -inf = masked column). v_row(j) returns the value row
  // (head_dim floats) of column j; it is not called for masked columns.
  template <class VRow>
  void update(std::span<const float> scores, VRow&& v_row) {
    float tile_max = kNegInf;
    for (float s : scores) tile_max = s > tile_max ? s : tile_max;
    if (tile_max == kNegInf) return;  // every column masked
    const float m_new = m_ > tile_max ? m_ : tile_max;
    rescale(m_new);
    const size_t d = acc_.size();
    for (size_t j = 0; j < scores.size(); ++j) {
      if (scores[j] == kNegInf) continue;
      const float p = std::exp(scores[j] - m_new);
      l_ += p;
      const float* v = v_row(j);
      for (size_t c = 0; c < d; ++c) acc_[c] += p * v[c];
    }
  }

  // Merges another (unnormalized) state (other_m, other_l, other_acc) into this one.
  void merge(float other_m, float other_l, std::span<const float> other_acc) {
    if (other_m == kNegInf || other_l == 0.0f) return;  // empty: contributes nothing
    const float m_new = m_ > other_m ? m_ : other_m;
    rescale(m_new);
    const float w = std::exp(other_m - m_new);
    l_ += other_l * w;
    for (size_t c = 0; c < acc_.size(); ++c) acc_[c] += w * other_acc[c];
  }
  void merge(const SoftmaxState& other) { merge(other.m_, other.l_, other.acc_); }
  // Merges a normalized partial result (o, lse).
  void merge_partial(float lse, std::span<const float> o) { merge(lse, 1.0f, o); }

  // Natural-log LSE of the scores seen (-inf when empty).
  float lse() const { return empty() ? kNegInf : m_ + std::log(l_); }

  // Writes acc / l (zeros when empty).
  void normalize_into(std::span<float> out) const {
    if (empty()) {
      for (float& o : out) o = 0.0f;
      return;
    }
    const float inv = 1.0f / l_;
    for (size_t c = 0; c < out.size(); ++c) out[c] = acc_[c] * inv;
  }

 private:
  // Moves the state to a new (finite, >= m_) max.
  void rescale(float m_new) {
    if (m_new == m_) return;
    const float s = m_ == kNegInf ? 0.0f : std::exp(m_ - m_new);
    m_ = m_new;
    if (s == 1.0f) return;
    l_ *= s;
    for (float& a : acc_) a *= s;
  }

  std::span<float> acc_;
  float m_ = kNegInf;
  float l_ = 0.0f;
};

}  // namespace fasttree
