#include "engine/model_config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace fasttree {

namespace {

using json = nlohmann::json;

constexpr int64_t kMaxHidden = int64_t{1} << 20;

// Typed field access with errors naming the source and the field.
class Fields {
 public:
  Fields(const json& obj, std::string source) : obj_(obj), source_(std::move(source)) {}

  bool has(const char* key) const { return obj_.contains(key) && !obj_[key].is_null(); }
  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    FT_FAIL(source_ + ": field '" + key + "' " + what);
  }
  const json& get(const char* key) const {
    if (!obj_.contains(key)) fail(key, "is missing");
    if (obj_[key].is_null()) fail(key, "is null");
    return obj_[key];
  }
  int64_t integer(const char* key) const {
    const json& v = get(key);
    if (!v.is_number_integer()) fail(key, "must be an integer, got " + v.dump());
    return v.get<int64_t>();
  }
  int64_t integer_or(const char* key, int64_t dflt) const { return has(key) ? integer(key) : dflt; }
  double number(const char* key) const {
    const json& v = get(key);
    if (!v.is_number()) fail(key, "must be a number, got " + v.dump());
    return v.get<double>();
  }
  double number_or(const char* key, double dflt) const { return has(key) ? number(key) : dflt; }
  bool boolean_or(const char* key, bool dflt) const {
    if (!has(key)) return dflt;
    const json& v = obj_[key];
    if (!v.is_boolean()) fail(key, "must be true or false, got " + v.dump());
    return v.get<bool>();
  }
  std::string string(const char* key) const {
    const json& v = get(key);
    if (!v.is_string()) fail(key, "must be a string, got " + v.dump());
    return v.get<std::string>();
  }
  const std::string& source() const { return source_; }

 private:
  const json& obj_;
  std::string source_;
};

int checked_int(const Fields& f, const char* key, int64_t v) {
  if (v < 0 || v > (int64_t{1} << 30)) f.fail(key, "is out of range: " + std::to_string(v));
  return static_cast<int>(v);
}

// rope_scaling (or rope_parameters) object -> RopeScaling.
RopeScaling parse_rope_scaling(const json& obj, const std::string& source, const char* field) {
  const std::string where = source + ": " + field;
  FT_CHECK(obj.is_object(), where + " must be an object or null, got " + obj.dump());
  const Fields f(obj, where);
  std::string type;
  if (f.has("rope_type")) type = f.string("rope_type");
  else if (f.has("type")) type = f.string("type");
  else FT_FAIL(where + " has neither 'rope_type' nor 'type'");
  RopeScaling s;
  if (type == "default") return s;
  FT_CHECK(type == "llama3", where + " type '" + type + "' is not supported (llama3, default or null)");
  s.type = RopeScalingType::kLlama3;
  s.factor = f.number("factor");
  s.low_freq_factor = f.number("low_freq_factor");
  s.high_freq_factor = f.number("high_freq_factor");
  s.original_max_position_embeddings = f.integer("original_max_position_embeddings");
  return s;
}

}  // namespace

int64_t ModelConfig::num_params() const {
  const int64_t h = hidden_size;
  const int64_t per_layer = 2 * h + h * q_dim() + 2 * h * kv_dim() + q_dim() * h + 3 * h * intermediate_size +
                            (attention_bias ? q_dim() + 2 * kv_dim() : 0) + (o_proj_bias() ? h : 0);
  return vocab_size * h * (tie_word_embeddings ? 1 : 2) + num_hidden_layers * per_layer + h;
}

void ModelConfig::validate(const std::string& source) const {
  auto positive = [&](const char* field, double v) {
    FT_CHECK(v > 0, source + ": " + field + " must be positive, got " + std::to_string(v));
  };
  FT_CHECK(model_type == "llama" || model_type == "mistral" || model_type == "qwen2",
           source + ": model_type '" + model_type + "' is not supported (llama, mistral, qwen2)");
  positive("hidden_size", static_cast<double>(hidden_size));
  positive("intermediate_size", static_cast<double>(intermediate_size));
  positive("num_hidden_layers", num_hidden_layers);
  positive("num_attention_heads", num_attention_heads);
  positive("num_key_value_heads", num_key_value_heads);
  positive("head_dim", head_dim);
  positive("vocab_size", static_cast<double>(vocab_size));
  positive("rms_norm_eps", rms_norm_eps);
  positive("rope_theta", rope_theta);
  positive("max_position_embeddings", static_cast<double>(max_position_embeddings));
  // Bounds far above any real model, so that sizes and parameter counts cannot overflow.
  auto at_most = [&](const char* field, int64_t v, int64_t limit) {
    FT_CHECK(v <= limit, source + ": " + field + " " + std::to_string(v) + " is implausibly large (limit " +
                             std::to_string(limit) + ")");
  };
  at_most("hidden_size", hidden_size, kMaxHidden);
  at_most("intermediate_size", intermediate_size, int64_t{1} << 22);
  at_most("num_hidden_layers", num_hidden_layers, int64_t{1} << 12);
  at_most("num_attention_heads", num_attention_heads, int64_t{1} << 14);
  at_most("head_dim", head_dim, int64_t{1} << 13);
  at_most("max_position_embeddings", max_position_embeddings, int64_t{1} << 40);
  FT_CHECK(num_attention_heads % num_key_value_heads == 0,
           source + ": num_attention_heads " + std::to_string(num_attention_heads) +
               " is not a multiple of num_key_value_heads " + std::to_string(num_key_value_heads));
  FT_CHECK(head_dim % 2 == 0, source + ": head_dim " + std::to_string(head_dim) + " must be even (RoPE)");
  FT_CHECK(vocab_size <= (int64_t{1} << 31) - 1, source + ": vocab_size " + std::to_string(vocab_size) +
                                                      " does not fit token ids of 32 bits");
  FT_CHECK(model_type != "qwen2" || attention_bias, source + ": qwen2 models always have attention biases");
  FT_CHECK(model_type != "mistral" || !attention_bias, source + ": mistral models have no attention biases");
  FT_CHECK(sliding_window >= 0, source + ": sliding_window must be null or positive");
  FT_CHECK(sliding_window == 0 || model_type == "mistral",
           source + ": sliding_window is only supported for mistral models");
  if (rope_scaling.type == RopeScalingType::kLlama3) {
    FT_CHECK(rope_scaling.factor >= 1.0,
             source + ": rope_scaling.factor must be >= 1, got " + std::to_string(rope_scaling.factor));
    FT_CHECK(rope_scaling.low_freq_factor > 0 && rope_scaling.high_freq_factor > rope_scaling.low_freq_factor,
             source + ": rope_scaling needs 0 < low_freq_factor < high_freq_factor, got " +
                 std::to_string(rope_scaling.low_freq_factor) + " and " +
                 std::to_string(rope_scaling.high_freq_factor));
    FT_CHECK(rope_scaling.original_max_position_embeddings > 0,
             source + ": rope_scaling.original_max_position_embeddings must be positive");
  }
}

ModelConfig parse_model_config(std::string_view json_text, const std::string& source) {
  json doc;
  try {
    doc = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {
    FT_FAIL(source + ": not valid JSON (" + e.what() + ")");
  }
  FT_CHECK(doc.is_object(), source + ": not a JSON object");
  const Fields f(doc, source);

  ModelConfig c;
  c.model_type = f.string("model_type");
  FT_CHECK(c.model_type == "llama" || c.model_type == "mistral" || c.model_type == "qwen2",
           source + ": model_type '" + c.model_type + "' is not supported (llama, mistral, qwen2)");
  const bool is_llama = c.model_type == "llama";
  const bool is_mistral = c.model_type == "mistral";
  const bool is_qwen2 = c.model_type == "qwen2";

  c.hidden_size = f.integer("hidden_size");
  c.intermediate_size = f.integer("intermediate_size");
  c.num_hidden_layers = checked_int(f, "num_hidden_layers", f.integer("num_hidden_layers"));
  c.num_attention_heads = checked_int(f, "num_attention_heads", f.integer("num_attention_heads"));
  FT_CHECK(c.num_attention_heads > 0, source + ": num_attention_heads must be positive, got 0");
  FT_CHECK(c.hidden_size > 0, source + ": hidden_size must be positive, got " + std::to_string(c.hidden_size));
  FT_CHECK(c.hidden_size <= kMaxHidden, source + ": hidden_size " + std::to_string(c.hidden_size) +
                                            " is implausibly large (limit " + std::to_string(kMaxHidden) + ")");
  c.num_key_value_heads =
      checked_int(f, "num_key_value_heads", f.integer_or("num_key_value_heads", c.num_attention_heads));
  c.head_dim = checked_int(f, "head_dim", f.integer_or("head_dim", c.hidden_size / c.num_attention_heads));
  c.vocab_size = f.integer("vocab_size");
  c.rms_norm_eps = f.number_or("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = f.boolean_or("tie_word_embeddings", false);
  c.max_position_embeddings =
      f.integer_or("max_position_embeddings", is_llama ? 2048 : is_mistral ? 131072 : 32768);
  c.attention_bias = is_qwen2 ? true : is_llama ? f.boolean_or("attention_bias", false) : false;

  if (f.has("hidden_act")) {
    const std::string act = f.string("hidden_act");
    FT_CHECK(act == "silu", source + ": field 'hidden_act' is '" + act + "', only 'silu' is supported");
  }
  FT_CHECK(!f.boolean_or("mlp_bias", false), source + ": field 'mlp_bias' true is not supported");
  if (is_mistral) {
    if (!doc.contains("sliding_window")) c.sliding_window = 4096;  // MistralConfig's default
    else if (!doc["sliding_window"].is_null()) c.sliding_window = f.integer("sliding_window");
  }
  if (is_qwen2)
    FT_CHECK(!f.boolean_or("use_sliding_window", false),
             source + ": field 'use_sliding_window' true is not supported");

  c.rope_theta = f.number_or("rope_theta", 10000.0);
  if (f.has("rope_scaling")) c.rope_scaling = parse_rope_scaling(doc["rope_scaling"], source, "rope_scaling");
  if (f.has("rope_parameters")) {
    const json& rp = doc["rope_parameters"];
    c.rope_scaling = parse_rope_scaling(rp, source, "rope_parameters");
    const Fields pf(rp, source + ": rope_parameters");
    if (pf.has("rope_theta")) c.rope_theta = pf.number("rope_theta");
  }
  c.validate(source);
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  std::filesystem::path p(path);
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec)) p /= "config.json";
  std::ifstream f(p, std::ios::binary);
  FT_CHECK(f.good(), p.string() + ": cannot open model config");
  std::ostringstream ss;
  ss << f.rdbuf();
  return parse_model_config(ss.str(), p.string());
}

std::string model_config_to_json(const ModelConfig& c) {
  nlohmann::ordered_json j;
  j["model_type"] = c.model_type;
  j["architectures"] = {c.model_type == "llama" ? "LlamaForCausalLM"
                        : c.model_type == "mistral" ? "MistralForCausalLM"
                                                    : "Qwen2ForCausalLM"};
  j["hidden_act"] = "silu";
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.type == RopeScalingType::kLlama3) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["vocab_size"] = c.vocab_size;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["max_position_embeddings"] = c.max_position_embeddings;
  if (c.model_type == "llama") j["attention_bias"] = c.attention_bias;
  if (c.model_type == "mistral") {
    if (c.sliding_window > 0) j["sliding_window"] = c.sliding_window;
    else j["sliding_window"] = nullptr;
  }
  if (c.model_type == "qwen2") j["use_sliding_window"] = false;
  j["torch_dtype"] = "bfloat16";
  return j.dump(2) + "\n";
}

namespace {

// The named shapes (HF configs of the models they are named after; rms_norm_eps 1e-5 for all).
struct PresetRow {
  const char* name;
  const char* model_type;
  int64_t hidden, intermediate;
  int layers, heads, kv_heads, head_dim;
  double rope_theta;
  int64_t vocab, max_positions;
  bool llama3_rope;  // Llama-3.1 RoPE scaling (factor 8, low 1, high 4, original 8192)
};
constexpr PresetRow kPresets[] = {
    {"tiny", "llama", 64, 128, 2, 4, 2, 16, 10000.0, 256, 1024, false},
    {"llama2-7b", "llama", 4096, 11008, 32, 32, 32, 128, 10000.0, 32000, 4096, false},   // meta-llama/Llama-2-7b-hf
    {"llama2-70b", "llama", 8192, 28672, 80, 64, 8, 128, 10000.0, 32000, 4096, false},   // meta-llama/Llama-2-70b-hf
    {"mistral-7b", "mistral", 4096, 14336, 32, 32, 8, 128, 1000000.0, 32768, 32768, false},  // Mistral-7B-v0.3
    {"llama3-8b", "llama", 4096, 14336, 32, 32, 8, 128, 500000.0, 128256, 131072, true},  // Llama-3.1-8B
};

}  // namespace

ModelConfig model_preset(std::string_view name) {
  for (const PresetRow& p : kPresets) {
    if (name != p.name) continue;
    ModelConfig c;
    c.model_type = p.model_type;
    c.hidden_size = p.hidden;
    c.intermediate_size = p.intermediate;
    c.num_hidden_layers = p.layers;
    c.num_attention_heads = p.heads;
    c.num_key_value_heads = p.kv_heads;
    c.head_dim = p.head_dim;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = p.rope_theta;
    if (p.llama3_rope) c.rope_scaling = {RopeScalingType::kLlama3, 8.0, 1.0, 4.0, 8192};
    c.vocab_size = p.vocab;
    c.max_position_embeddings = p.max_positions;
    c.validate("preset " + std::string(name));
    return c;
  }
  std::string known;
  for (const std::string& n : model_preset_names()) known += (known.empty() ? "" : ", ") + n;
  FT_FAIL("unknown model preset '" + std::string(name) + "' (known: " + known + ")");
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const PresetRow& p : kPresets) names.emplace_back(p.name);
  return names;
}

bool operator==(const RopeScaling& a, const RopeScaling& b) {
  if (a.type != b.type) return false;
  if (a.type == RopeScalingType::kNone) return true;
  return a.factor == b.factor && a.low_freq_factor == b.low_freq_factor && a.high_freq_factor == b.high_freq_factor &&
         a.original_max_position_embeddings == b.original_max_position_embeddings;
}

bool operator==(const ModelConfig& a, const ModelConfig& b) {
  return a.model_type == b.model_type && a.hidden_size == b.hidden_size && a.intermediate_size == b.intermediate_size &&
         a.num_hidden_layers == b.num_hidden_layers && a.num_attention_heads == b.num_attention_heads &&
         a.num_key_value_heads == b.num_key_value_heads && a.head_dim == b.head_dim &&
         a.rms_norm_eps == b.rms_norm_eps && a.rope_theta == b.rope_theta && a.rope_scaling == b.rope_scaling &&
         a.vocab_size == b.vocab_size && a.tie_word_embeddings == b.tie_word_embeddings &&
         a.attention_bias == b.attention_bias && a.max_position_embeddings == b.max_position_embeddings &&
         a.sliding_window == b.sliding_window;
}

}  // namespace fasttree
