// Device-memory arithmetic of the GPU model (engine/gpu_model.h); no device access, built with or
// without the CUDA backend.
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "core/error.h"
#include "cuda/gemm.h"
#include "engine/gpu_model.h"

namespace fasttree {

int gpu_kernel_head_dim(int head_dim) {
  FT_CHECK(head_dim > 0 && head_dim % 2 == 0,
           "GPU model: head_dim must be positive and even, got " + std::to_string(head_dim));
  for (int dk : {64, 128, 256})
    if (head_dim <= dk) return dk;
  FT_FAIL("GPU model: head_dim " + std::to_string(head_dim) + " has no attention kernel (at most 256)");
}

int64_t gpu_kv_bytes_per_slot(const ModelConfig& c) {
  const int64_t dk = gpu_kernel_head_dim(c.head_dim);
  return int64_t{2} * c.num_hidden_layers * c.num_key_value_heads * dk * 2;
}

int64_t gpu_activation_bytes(const ModelConfig& c, int64_t rows) {
  const int64_t dk = gpu_kernel_head_dim(c.head_dim);
  const int64_t h = c.hidden_size, inter = c.intermediate_size, qd = c.num_attention_heads * dk;
  const int64_t qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * dk;
  const int64_t per_row = h * 4 + h * 2 + qkv * 4 + qd * 2 + qd * 4 + qd * 2 + h * 4 + 2 * inter * 2 + inter * 2 + 16;
  const int64_t logits = std::min<int64_t>(rows, kMaxLogitRows) * c.vocab_size * 4;
  const int64_t attention_partials = rows * qd * 4 * 2;  // rough allowance for the tree kernel's workspace
  return rows * per_row + logits + attention_partials + static_cast<int64_t>(kGemmWorkspaceBytes);
}

int32_t gpu_max_kv_slots(const ModelConfig& c, int64_t free_bytes, double fraction, int prefill_chunk) {
  const double room = static_cast<double>(free_bytes) * fraction - static_cast<double>(gpu_activation_bytes(c, prefill_chunk));
  if (room <= 0) return 0;
  const double slots = std::floor(room / static_cast<double>(gpu_kv_bytes_per_slot(c)));
  return static_cast<int32_t>(std::min(slots, static_cast<double>(INT32_MAX)));
}

}  // namespace fasttree
