// GpuWeights: a Llama-family model's weights in device memory for the GPU model
// (engine/gpu_model.h), in one allocation. bf16 except the biases (fp32). With
// dk = gpu_kernel_head_dim (engine/gpu_model.h), Hq/Hkv heads, h hidden, I intermediate, V vocab:
//   embed       bf16 [V, h]
//   per layer:
//     input_norm  bf16 [h]
//     w_qkv       bf16 [(Hq + 2 Hkv) * dk, h]   q rows (head by head), then k rows, then v rows
//     b_qkv       fp32 [(Hq + 2 Hkv) * dk]      nullptr unless attention_bias
//     w_o         bf16 [h, Hq * dk]
//     b_o         fp32 [h]                      nullptr unless config.o_proj_bias()
//     post_norm   bf16 [h]
//     w_gate_up   bf16 [2 I, h]                 gate rows, then up rows
//     w_down      bf16 [h, I]
//   final_norm  bf16 [h]
//   lm_head     bf16 [V, h]                     = embed when tie_word_embeddings
//
// Head-dim padding. The attention kernels exist for head_dim 64, 128 and 256; a model whose
// head_dim d is smaller (the tiny test models: 16) runs with dk = the smallest of those >= d.
// Head-local dimension j < d/2 sits at j, dimension j >= d/2 at dk/2 + (j - d/2); the other dk - d
// dimensions are zero rows of W_q/W_k/W_v (and zero biases) and zero columns of W_o. RoPE's
// rotate_half pairs (j, j + d/2) then sit at (j, j + dk/2), which is what a dk-dim RoPE rotates
// with inv_freq[j] for j < d/2 (the model passes inv_freq = 0 for the padded pairs, and
// sm_scale = 1/sqrt(d)): q·k, the attention output and o_proj are exactly the unpadded ones.
//
// Sources (all convert to bf16 with round-to-nearest-even; biases stay fp32):
//   upload_gpu_weights   fp32 host ModelWeights (tiny models, golden tests)
//   load_gpu_weights     a HF checkpoint, tensor by tensor from the mmap'd safetensors (F32, F16,
//                        BF16) through pinned staging buffers: no fp32 host copy of the model
//                        (load_gpu_weights_shard: a tensor-parallel rank's blocks only)
//   random_gpu_weights   seeded random weights with random_weights' distributions (engine/weights.h),
//                        generated on the device (cuda_ops::fill_uniform_bf16; biases, tiny, on the
//                        host). Models of at most kGpuHostRandomMaxParams parameters take
//                        random_weights' exact values instead (host, then uploaded), so a small
//                        preset has the same weights (up to bf16 rounding) on both backends.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/device.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "engine/weights.h"

struct CUstream_st;

namespace fasttree {

inline constexpr int64_t kGpuHostRandomMaxParams = int64_t{64} << 20;

struct GpuLayerWeights {
  uint16_t* input_norm = nullptr;
  uint16_t* w_qkv = nullptr;
  float* b_qkv = nullptr;
  uint16_t* w_o = nullptr;
  float* b_o = nullptr;
  uint16_t* post_norm = nullptr;
  uint16_t* w_gate_up = nullptr;
  uint16_t* w_down = nullptr;
};

class GpuWeights {
 public:
  // Allocates (uninitialised) device memory for `config`'s weights.
  explicit GpuWeights(const ModelConfig& config);
  GpuWeights(GpuWeights&&) noexcept = default;
  GpuWeights& operator=(GpuWeights&&) noexcept = default;

  const ModelConfig& config() const { return config_; }
  int kernel_head_dim() const { return dk_; }
  size_t bytes() const { return arena_.bytes(); }

  uint16_t* embed = nullptr;
  std::vector<GpuLayerWeights> layers;
  uint16_t* final_norm = nullptr;
  uint16_t* lm_head = nullptr;

 private:
  ModelConfig config_;
  int dk_ = 0;
  DeviceBuffer arena_;
};

// Device bytes of `config`'s weights in this layout (padding and alignment included).
size_t gpu_weight_bytes(const ModelConfig& config);

GpuWeights upload_gpu_weights(const ModelWeights& weights, CUstream_st* stream);
// Every tensor of `config` (engine/weights.h's list) must be in the folder with its shape: errors
// name a missing tensor (and a few unused checkpoint tensors), or the file, tensor and both shapes.
GpuWeights load_gpu_weights(const SafetensorsFolder& folder, const ModelConfig& config, CUstream_st* stream);
// Rank `rank`'s tensor-parallel shard (config tp_local_config(config, tp)) read straight from the
// checkpoint: the same checks as load_gpu_weights on the whole model's tensors, then only the
// rank's block of each tensor (engine/tp_shard.h: tp_block) is converted and uploaded, so no
// process needs the whole model in host memory. The same bf16 values as
// upload_gpu_weights(shard_weights(load_weights(folder, config))) (each value is rounded to bf16
// once either way). tp 1 = load_gpu_weights.
GpuWeights load_gpu_weights_shard(const SafetensorsFolder& folder, const ModelConfig& config, int rank, int tp,
                                  CUstream_st* stream);
GpuWeights random_gpu_weights(const ModelConfig& config, uint64_t seed, CUstream_st* stream);
// Rank `rank`'s tensor-parallel shard (engine/tp_shard.h: config tp_local_config(config, tp)) of
// EXACTLY the weights random_gpu_weights(config, seed) gives: each split tensor is generated whole
// on the device (same seed, distribution and padding; one scratch tensor at a time) and the rank's
// row or column block copied out (cudaMemcpy2DAsync for column blocks); small models take
// shard_weights(random_weights(...)). o_proj's bias: rank 0's whole, zeros on the others (it is
// added before the all-reduce, so the sum counts it once). tp 1 = random_gpu_weights.
GpuWeights random_gpu_weights_shard(const ModelConfig& config, uint64_t seed, int rank, int tp, CUstream_st* stream);

}  // namespace fasttree
