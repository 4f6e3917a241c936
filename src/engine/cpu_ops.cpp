#include "engine/cpu_ops.h"

#include <cmath>
#include <string>

#include "core/error.h"
#include "cpu/parallel.h"

namespace fasttree {

namespace {

std::string sz(size_t n) { return std::to_string(n); }

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

constexpr int64_t kRowsPerTask = 16;              // rows of W per parallel task
constexpr int64_t kMinParallelWork = int64_t{1} << 18;  // multiply-adds below which one thread is used

}  // namespace

void rms_norm(std::span<const float> x, std::span<const float> weight, float eps, std::span<float> out) {
  const size_t dim = weight.size();
  FT_CHECK(dim > 0 && x.size() % dim == 0,
           "rms_norm: x has " + sz(x.size()) + " floats, not a multiple of the weight's " + sz(dim));
  FT_CHECK(out.size() == x.size(), "rms_norm: out has " + sz(out.size()) + " floats, x has " + sz(x.size()));
  const size_t n = x.size() / dim;
  for (size_t r = 0; r < n; ++r) {
    const float* xr = x.data() + r * dim;
    float* yr = out.data() + r * dim;
    double ss = 0.0;
    for (size_t c = 0; c < dim; ++c) ss += static_cast<double>(xr[c]) * xr[c];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + static_cast<double>(eps)));
    for (size_t c = 0; c < dim; ++c) yr[c] = weight[c] * (xr[c] * inv);
  }
}

void linear(std::span<const float> x, int64_t n, std::span<const float> w, int64_t out_dim, int64_t in_dim,
            std::span<const float> bias, std::span<float> y, int num_threads) {
  FT_CHECK(n >= 0 && out_dim > 0 && in_dim > 0, "linear: bad sizes n=" + std::to_string(n) + " out=" +
                                                    std::to_string(out_dim) + " in=" + std::to_string(in_dim));
  FT_CHECK(x.size() == static_cast<size_t>(n * in_dim),
           "linear: x has " + sz(x.size()) + " floats, expected n*in = " + std::to_string(n * in_dim));
  FT_CHECK(w.size() == static_cast<size_t>(out_dim * in_dim),
           "linear: weight has " + sz(w.size()) + " floats, expected out*in = " + std::to_string(out_dim * in_dim));
  FT_CHECK(bias.empty() || bias.size() == static_cast<size_t>(out_dim),
           "linear: bias has " + sz(bias.size()) + " floats, expected 0 or " + std::to_string(out_dim));
  FT_CHECK(y.size() == static_cast<size_t>(n * out_dim),
           "linear: y has " + sz(y.size()) + " floats, expected n*out = " + std::to_string(n * out_dim));
  const int64_t tasks = (out_dim + kRowsPerTask - 1) / kRowsPerTask;
  auto task = [&](int64_t t) {
    const int64_t o0 = t * kRowsPerTask;
    const int64_t o1 = std::min(out_dim, o0 + kRowsPerTask);
    for (int64_t r = 0; r < n; ++r) {
      const float* xr = x.data() + r * in_dim;
      float* yr = y.data() + r * out_dim;
      for (int64_t o = o0; o < o1; ++o) {
        const float v = dot(xr, w.data() + o * in_dim, in_dim);
        yr[o] = bias.empty() ? v : v + bias[o];
      }
    }
  };
  const bool small = n * out_dim * in_dim < kMinParallelWork;
  parallel_for(tasks, task, small ? 1 : num_threads);
}

void silu_mul(std::span<float> gate, std::span<const float> up) {
  FT_CHECK(gate.size() == up.size(), "silu_mul: gate has " + sz(gate.size()) + " floats, up has " + sz(up.size()));
  for (size_t i = 0; i < gate.size(); ++i) {
    const float g = gate[i];
    gate[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void add_inplace(std::span<float> acc, std::span<const float> x) {
  FT_CHECK(acc.size() == x.size(), "add_inplace: sizes differ (" + sz(acc.size()) + " vs " + sz(x.size()) + ")");
  for (size_t i = 0; i < acc.size(); ++i) acc[i] += x[i];
}

}  // namespace fasttree
