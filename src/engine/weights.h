// ModelWeights: fp32 host tensors of a Llama-family model (the CPU path), loaded from a
// safetensors checkpoint with HF names, or seeded random weights for a config.
//
// HF names and shapes (h = hidden, I = intermediate, V = vocab, qd = Hq*d, kvd = Hkv*d):
//   model.embed_tokens.weight                         [V, h]
//   model.layers.{i}.input_layernorm.weight           [h]
//   model.layers.{i}.self_attn.q_proj.weight          [qd, h]    (.bias [qd] when attention_bias)
//   model.layers.{i}.self_attn.k_proj.weight          [kvd, h]   (.bias [kvd] when attention_bias)
//   model.layers.{i}.self_attn.v_proj.weight          [kvd, h]   (.bias [kvd] when attention_bias)
//   model.layers.{i}.self_attn.o_proj.weight          [h, qd]    (.bias [h] when o_proj_bias(): llama
//                                                                with attention_bias)
//   model.layers.{i}.post_attention_layernorm.weight  [h]
//   model.layers.{i}.mlp.gate_proj.weight             [I, h]
//   model.layers.{i}.mlp.up_proj.weight               [I, h]
//   model.layers.{i}.mlp.down_proj.weight             [h, I]
//   model.norm.weight                                 [h]
//   lm_head.weight                                    [V, h]     (absent / ignored when tied)
// Tensors of the checkpoint that are not listed here are ignored.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/npy.h"  // DType
#include "engine/model_config.h"
#include "engine/safetensors.h"

namespace fasttree {

struct LayerWeights {
  std::vector<float> input_norm;           // [h]
  std::vector<float> wq, wk, wv, wo;       // [qd, h], [kvd, h], [kvd, h], [h, qd]
  std::vector<float> bq, bk, bv;           // [qd], [kvd], [kvd]; empty unless attention_bias
  std::vector<float> bo;                   // [h]; empty unless config.o_proj_bias()
  std::vector<float> post_norm;            // [h]
  std::vector<float> w_gate, w_up, w_down; // [I, h], [I, h], [h, I]
};

struct ModelWeights {
  ModelConfig config;
  std::vector<float> embed;       // [V, h]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [h]
  std::vector<float> lm_head;     // [V, h]; empty when config.tie_word_embeddings

  // lm_head, or the embedding when tied.
  std::span<const float> output_weight() const { return config.tie_word_embeddings ? embed : lm_head; }
};

// One expected tensor: its HF name, shape, and the vector of `w` that holds it.
struct WeightTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float>* data;
};
// Every tensor a model of w.config has, in checkpoint order (embed, layers, norm, lm_head).
std::vector<WeightTensor> weight_tensors(ModelWeights& w);

// Largest model the fp32 CPU path accepts (load and random init refuse bigger ones clearly).
inline constexpr int64_t kMaxCpuParams = int64_t{2} << 30;

// Loads every tensor of `config` from the checkpoint, converting BF16/F16/F32 to fp32. A missing
// tensor is an error naming it (and listing a few unused checkpoint tensors, which are likely
// misnamed); a wrong shape names the tensor, the file and both shapes.
// Every tensor of `config` must be in the folder with its shape: errors name the first missing
// tensor (and a few unused checkpoint tensors), or the file, tensor and both shapes. Reads no data.
void check_checkpoint(const SafetensorsFolder& folder, const ModelConfig& config);
ModelWeights load_weights(const SafetensorsFolder& folder, const ModelConfig& config, int num_threads = 0);

// Seeded random weights: norms 1 + U(-0.1, 0.1); embedding U(-1, 1); every projection
// U(-a, a) with a = sqrt(3 / fan_in) (unit-variance outputs for unit-variance inputs); biases
// U(-0.1, 0.1). Deterministic for a seed on every platform (own uniform mapping of mt19937_64).
ModelWeights random_weights(const ModelConfig& config, uint64_t seed);

// Writes the weights as one safetensors file with HF names (values rounded to `dtype`).
void save_weights(const ModelWeights& w, const std::string& path, DType dtype = DType::kF32);

}  // namespace fasttree
