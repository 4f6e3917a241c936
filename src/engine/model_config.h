// ModelConfig: the shape of a Llama-family decoder (Llama-2/3, Mistral, Qwen2), parsed from a
// HuggingFace config.json or taken from a named preset.
//
// Tensor shapes it implies (HF layout, [out, in]):
//   embed / lm_head [vocab_size, hidden_size]
//   q_proj [num_attention_heads * head_dim, hidden]   k/v_proj [num_key_value_heads * head_dim, hidden]
//   o_proj [hidden, num_attention_heads * head_dim]
//   gate/up_proj [intermediate_size, hidden]          down_proj [hidden, intermediate_size]
//
// Parsing (parse_model_config): model_type must be llama, mistral or qwen2. Required fields:
// model_type, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size.
// Optional fields take HF's defaults: num_key_value_heads = num_attention_heads, head_dim =
// hidden_size / num_attention_heads, rms_norm_eps = 1e-6, rope_theta = 10000, rope_scaling = null,
// tie_word_embeddings = false, attention_bias = false for llama (absent for mistral: false; qwen2
// always has q/k/v biases, and no o_proj bias), max_position_embeddings (llama 2048, mistral 131072, qwen2 32768),
// sliding_window (mistral only: default 4096, null = none; qwen2 with use_sliding_window true is
// rejected). A "rope_parameters" object (newer transformers) is read like rope_theta + rope_scaling.
// Rejected: hidden_act other than silu, mlp_bias true, rope_scaling other than llama3 / default,
// and every missing, mistyped or out-of-range field, in one-line errors naming the source and field.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/attention_shape.h"

namespace fasttree {

enum class RopeScalingType {
  kNone,    // plain RoPE (HF rope_type "default")
  kLlama3,  // HF _compute_llama3_parameters
};

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string model_type = "llama";  // llama | mistral | qwen2
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projections carry biases (qwen2; llama: o_proj too)
  int64_t max_position_embeddings = 2048;
  int64_t sliding_window = 0;   // 0 = none

  int64_t q_dim() const { return int64_t{num_attention_heads} * head_dim; }
  int64_t kv_dim() const { return int64_t{num_key_value_heads} * head_dim; }
  // HF LlamaAttention gives o_proj a bias when attention_bias is set; Qwen2's o_proj has none.
  bool o_proj_bias() const { return attention_bias && model_type == "llama"; }
  AttnShape attn_shape() const { return {num_attention_heads, num_key_value_heads, head_dim}; }
  int64_t num_params() const;  // weights of the model (lm_head counted once when tied)
  // Throws naming `source` and the field when a value is out of range or inconsistent (sizes must
  // be positive, heads a multiple of kv heads, head_dim even, llama3 factors sane, ...).
  void validate(const std::string& source = "model config") const;
};

// Parses the text of a HF config.json; `source` (a path) prefixes every error.
ModelConfig parse_model_config(std::string_view json_text, const std::string& source = "config.json");
// Reads `path`, or `path`/config.json when path is a folder.
ModelConfig load_model_config(const std::string& path);
// HF-style config.json text for a config (what parse_model_config reads back to an equal config).
std::string model_config_to_json(const ModelConfig& config);

// Named shapes: "tiny" (hidden 64, 2 layers, 4 heads / 2 kv heads of 16, intermediate 128,
// vocab 256), "llama2-7b" (Llama-2-7b-hf), "mistral-7b" (Mistral-7B-v0.3: GQA 4, no sliding
// window), "llama3-8b" (Llama-3.1-8B: GQA 4, llama3 RoPE scaling). Unknown names throw, listing
// the known ones.
ModelConfig model_preset(std::string_view name);
std::vector<std::string> model_preset_names();

bool operator==(const RopeScaling& a, const RopeScaling& b);
bool operator==(const ModelConfig& a, const ModelConfig& b);

}  // namespace fasttree
