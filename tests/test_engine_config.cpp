// ModelConfig (engine/model_config.h): HF config.json snippets of Llama-2, Mistral, Qwen2 and
// Llama-3.1 (with llama3 RoPE scaling), defaults, presets, round trips, and bad fields -> one-line
// errors naming the field.
#include <gtest/gtest.h>

#include <string>

#include "engine/model_config.h"
#include "engine_test_util.h"

namespace fasttree {
namespace {

using test::expect_error;

constexpr const char* kLlama2 = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null, "tie_word_embeddings": false,
  "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": true, "vocab_size": 32000})";

constexpr const char* kMistral = R"({
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
  "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000})";

constexpr const char* kQwen2 = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
  "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
  "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
  "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936})";

constexpr const char* kLlama31 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 128000,
  "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
  "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
  "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
  "use_cache": true, "vocab_size": 128256})";

// Replaces the first occurrence of `from` in `text` by `to` (the snippet must contain it).
std::string edit(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

TEST(EngineConfig, ParsesRealConfigs) {
  const ModelConfig l2 = parse_model_config(kLlama2);
  EXPECT_EQ(l2, model_preset("llama2-7b"));
  EXPECT_EQ(l2.head_dim, 128);
  EXPECT_EQ(l2.num_params(), 6738415616);
  EXPECT_FALSE(l2.attention_bias);

  const ModelConfig m = parse_model_config(kMistral);
  EXPECT_EQ(m.model_type, "mistral");
  EXPECT_EQ(m.num_key_value_heads, 8);
  EXPECT_EQ(m.attn_shape().gqa(), 4);
  EXPECT_EQ(m.sliding_window, 4096);
  EXPECT_EQ(m.rope_theta, 10000.0);
  EXPECT_EQ(m.rope_scaling.type, RopeScalingType::kNone);

  const ModelConfig q = parse_model_config(kQwen2);
  EXPECT_EQ(q.model_type, "qwen2");
  EXPECT_TRUE(q.attention_bias);  // Qwen2 always has q/k/v biases
  EXPECT_TRUE(q.tie_word_embeddings);
  EXPECT_EQ(q.head_dim, 64);
  EXPECT_EQ(q.sliding_window, 0);  // use_sliding_window false
  EXPECT_EQ(q.rms_norm_eps, 1e-6);
  EXPECT_EQ(q.num_params(), 494032768);  // Qwen2-0.5B

  const ModelConfig l3 = parse_model_config(kLlama31);
  EXPECT_EQ(l3, model_preset("llama3-8b"));
  EXPECT_EQ(l3.rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(l3.rope_scaling.factor, 8.0);
  EXPECT_EQ(l3.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(l3.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(l3.rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(l3.num_params(), 8030261248);

  // Older spelling "type", and the newer "rope_parameters" object.
  const ModelConfig old_type = parse_model_config(edit(kLlama31, R"("rope_type": "llama3")", R"("type": "llama3")"));
  EXPECT_EQ(old_type, l3);
  const ModelConfig params = parse_model_config(edit(
      edit(kLlama31, R"("rope_theta": 500000.0,)", ""), R"("rope_scaling")", R"("rope_theta": 1.0, "rope_parameters")"));
  EXPECT_EQ(params.rope_scaling, l3.rope_scaling);
  EXPECT_EQ(params.rope_theta, 1.0);  // top-level rope_theta; rope_parameters has none here
  const ModelConfig params2 = parse_model_config(
      edit(kLlama2, R"("rope_scaling": null)", R"("rope_parameters": {"rope_type": "default", "rope_theta": 250000.0})"));
  EXPECT_EQ(params2.rope_theta, 250000.0);
  EXPECT_EQ(params2.rope_scaling.type, RopeScalingType::kNone);
}

TEST(EngineConfig, DefaultsFollowHf) {
  const ModelConfig c = parse_model_config(
      R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 100, "num_hidden_layers": 1,
          "num_attention_heads": 4, "vocab_size": 10})");
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.max_position_embeddings, 2048);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  const ModelConfig m = parse_model_config(
      R"({"model_type": "mistral", "hidden_size": 64, "intermediate_size": 100, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 10})");
  EXPECT_EQ(m.sliding_window, 4096);  // MistralConfig's default
  EXPECT_EQ(m.head_dim, 32);          // explicit head_dim wins over hidden / heads
  EXPECT_EQ(m.q_dim(), 128);
  EXPECT_EQ(m.max_position_embeddings, 131072);
  const ModelConfig m2 = parse_model_config(edit(kMistral, R"("sliding_window": 4096)", R"("sliding_window": null)"));
  EXPECT_EQ(m2.sliding_window, 0);
  const ModelConfig bias = parse_model_config(edit(kLlama2, R"("pretraining_tp": 1)", R"("attention_bias": true)"));
  EXPECT_TRUE(bias.attention_bias);
  EXPECT_TRUE(bias.o_proj_bias());
  EXPECT_EQ(bias.num_params(), 6738415616 + 32 * (3 * 4096 + 4096));
  EXPECT_FALSE(parse_model_config(kQwen2).o_proj_bias());
}

TEST(EngineConfig, PresetsAndRoundTrip) {
  for (const std::string& name : model_preset_names()) {
    const ModelConfig c = model_preset(name);
    EXPECT_EQ(parse_model_config(model_config_to_json(c), name), c) << name;
  }
  const ModelConfig tiny = model_preset("tiny");
  EXPECT_EQ(tiny.hidden_size, 64);
  EXPECT_EQ(tiny.num_hidden_layers, 2);
  EXPECT_EQ(tiny.num_attention_heads, 4);
  EXPECT_EQ(tiny.num_key_value_heads, 2);
  EXPECT_EQ(tiny.vocab_size, 256);
  const ModelConfig mistral = model_preset("mistral-7b");
  EXPECT_EQ(mistral.attn_shape().gqa(), 4);
  EXPECT_EQ(mistral.num_params(), 7248023552);  // Mistral-7B-v0.3
  for (const char* snippet : {kMistral, kQwen2}) {
    const ModelConfig c = parse_model_config(snippet);
    EXPECT_EQ(parse_model_config(model_config_to_json(c)), c);
  }
  expect_error([] { model_preset("llama-70b"); }, {"llama-70b", "tiny", "llama3-8b"});

  test::TempDir dir;
  dir.write("config.json", kQwen2);
  EXPECT_EQ(load_model_config(dir.path()), parse_model_config(kQwen2));
  EXPECT_EQ(load_model_config(dir.path("config.json")), parse_model_config(kQwen2));
  expect_error([&] { load_model_config(dir.path("sub")); }, {"sub", "cannot open"});
}

TEST(EngineConfig, BadFieldsAreNamed) {
  struct Case {
    const char* name;
    std::string text;
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {"bad_json", "{\"model_type\": ", {"not valid JSON"}},
      {"not_object", "[1]", {"not a JSON object"}},
      {"missing_hidden", edit(kLlama2, R"("hidden_size": 4096,)", ""), {"field 'hidden_size' is missing"}},
      {"misnamed_heads", edit(kLlama2, "\"num_attention_heads\"", "\"num_heads\""),
       {"field 'num_attention_heads' is missing"}},
      {"string_int", edit(kLlama2, R"("hidden_size": 4096)", R"("hidden_size": "4096")"),
       {"field 'hidden_size' must be an integer", "\"4096\""}},
      {"float_int", edit(kLlama2, R"("num_hidden_layers": 32)", R"("num_hidden_layers": 32.5)"),
       {"field 'num_hidden_layers' must be an integer"}},
      {"null_vocab", edit(kLlama2, R"("vocab_size": 32000)", R"("vocab_size": null)"), {"field 'vocab_size' is null"}},
      {"bool_type", edit(kLlama2, R"("tie_word_embeddings": false)", R"("tie_word_embeddings": "no")"),
       {"field 'tie_word_embeddings' must be true or false"}},
      {"eps_type", edit(kLlama2, R"("rms_norm_eps": 1e-05)", R"("rms_norm_eps": "tiny")"),
       {"field 'rms_norm_eps' must be a number"}},
      {"model_type", edit(kLlama2, R"("model_type": "llama")", R"("model_type": "gpt2")"),
       {"model_type 'gpt2' is not supported", "llama, mistral, qwen2"}},
      {"no_model_type", edit(kLlama2, R"("model_type": "llama",)", ""), {"field 'model_type' is missing"}},
      {"gqa", edit(kLlama2, R"("num_key_value_heads": 32)", R"("num_key_value_heads": 5)"),
       {"num_attention_heads 32", "not a multiple of num_key_value_heads 5"}},
      {"zero_kv", edit(kLlama2, R"("num_key_value_heads": 32)", R"("num_key_value_heads": 0)"),
       {"num_key_value_heads must be positive"}},
      {"zero_heads", edit(kLlama2, R"("num_attention_heads": 32)", R"("num_attention_heads": 0)"),
       {"num_attention_heads must be positive"}},
      {"negative_hidden", edit(kLlama2, R"("hidden_size": 4096)", R"("hidden_size": -1)"),
       {"hidden_size must be positive"}},
      {"odd_head_dim", edit(kLlama2, R"("pretraining_tp": 1)", R"("head_dim": 127)"), {"head_dim 127 must be even"}},
      {"act", edit(kLlama2, R"("hidden_act": "silu")", R"("hidden_act": "gelu")"), {"'hidden_act' is 'gelu'"}},
      {"mlp_bias", edit(kLlama31, R"("mlp_bias": false)", R"("mlp_bias": true)"), {"'mlp_bias' true"}},
      {"qwen_sliding", edit(kQwen2, R"("use_sliding_window": false)", R"("use_sliding_window": true)"),
       {"'use_sliding_window' true is not supported"}},
      {"rope_linear", edit(kLlama31, R"("rope_type": "llama3")", R"("rope_type": "linear")"),
       {"rope_scaling type 'linear' is not supported"}},
      {"rope_yarn_old", edit(kLlama31, R"("rope_type": "llama3")", R"("type": "yarn")"),
       {"rope_scaling type 'yarn' is not supported"}},
      {"rope_no_type", edit(kLlama31, R"(, "rope_type": "llama3")", ""), {"rope_scaling has neither 'rope_type'"}},
      {"rope_no_factor", edit(kLlama31, R"("factor": 8.0, )", ""), {"rope_scaling: field 'factor' is missing"}},
      {"rope_factor_type", edit(kLlama31, R"("factor": 8.0)", R"("factor": "8")"),
       {"rope_scaling: field 'factor' must be a number"}},
      {"rope_orig_float", edit(kLlama31, R"("original_max_position_embeddings": 8192)",
                               R"("original_max_position_embeddings": 8192.5)"),
       {"field 'original_max_position_embeddings' must be an integer"}},
      {"rope_freq_order", edit(kLlama31, R"("high_freq_factor": 4.0)", R"("high_freq_factor": 1.0)"),
       {"low_freq_factor < high_freq_factor"}},
      {"rope_small_factor", edit(kLlama31, R"("factor": 8.0)", R"("factor": 0.5)"), {"factor must be >= 1"}},
      {"rope_not_object", edit(kLlama31, R"("rope_scaling": {)", R"("rope_scaling": 3, "x": {)"),
       {"rope_scaling must be an object or null"}},
      {"huge_hidden", edit(kLlama2, R"("hidden_size": 4096)", R"("hidden_size": 4096000000000)"),
       {"hidden_size 4096000000000 is implausibly large"}},
      {"huge_layers", edit(kLlama2, R"("num_hidden_layers": 32)", R"("num_hidden_layers": 99999999999)"),
       {"field 'num_hidden_layers' is out of range"}},
      {"sliding_type", edit(kMistral, R"("sliding_window": 4096)", R"("sliding_window": "4k")"),
       {"field 'sliding_window' must be an integer"}},
  };
  for (const Case& c : cases) {
    expect_error([&] { parse_model_config(c.text, "models/x/config.json"); },
                 [&] {
                   std::vector<std::string> f = c.fragments;
                   f.push_back("models/x/config.json");
                   return f;
                 }(),
                 c.name);
  }
}

}  // namespace
}  // namespace fasttree
