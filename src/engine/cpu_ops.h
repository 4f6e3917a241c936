// fp32 building blocks of the CPU model. Row-major; n = number of token rows.
//   rms_norm  x [n, dim], weight [dim] -> out [n, dim]:  out = weight * x / sqrt(mean(x²) + eps)
//             (HF LlamaRMSNorm; the mean is accumulated in double). out may alias x.
//   linear    x [n, in], W [out, in] (HF layout), bias [out] or empty -> y [n, out] = x·Wᵀ + bias
//             (fp32, 8 partial sums per dot product; blocks of W's rows spread over threads).
//   silu_mul  gate [n, I], up [n, I]: gate <- silu(gate) * up   (SwiGLU, silu(x) = x / (1 + e^-x))
//   add_inplace acc += x (same size)
// Size mismatches throw fasttree::Error naming the op and the operand.
#pragma once
#include <cstdint>
#include <span>

namespace fasttree {

void rms_norm(std::span<const float> x, std::span<const float> weight, float eps, std::span<float> out);

void linear(std::span<const float> x, int64_t n, std::span<const float> w, int64_t out_dim, int64_t in_dim,
            std::span<const float> bias, std::span<float> y, int num_threads = 0);

void silu_mul(std::span<float> gate, std::span<const float> up);

void add_inplace(std::span<float> acc, std::span<const float> x);

}  // namespace fasttree
