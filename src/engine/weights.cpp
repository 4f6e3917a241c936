#include "engine/weights.h"

#include <cmath>
#include <random>
#include <set>

#include "core/error.h"
#include "cpu/parallel.h"
#include "engine/safetensors_writer.h"

namespace fasttree {

namespace {

void check_cpu_size(const ModelConfig& c, const char* what) {
  FT_CHECK(c.num_params() <= kMaxCpuParams,
           std::string(what) + ": the model has " + std::to_string(c.num_params()) +
               " parameters; the fp32 CPU path takes at most " + std::to_string(kMaxCpuParams));
}

void resize(ModelWeights& w) {
  w.layers.assign(static_cast<size_t>(w.config.num_hidden_layers), LayerWeights{});
}

}  // namespace

std::vector<WeightTensor> weight_tensors(ModelWeights& w) {
  const ModelConfig& c = w.config;
  const int64_t h = c.hidden_size, inter = c.intermediate_size, v = c.vocab_size;
  const int64_t qd = c.q_dim(), kvd = c.kv_dim();
  FT_CHECK(w.layers.size() == static_cast<size_t>(c.num_hidden_layers),
           "weight_tensors: " + std::to_string(w.layers.size()) + " layers for a config of " +
               std::to_string(c.num_hidden_layers));
  std::vector<WeightTensor> out;
  out.push_back({"model.embed_tokens.weight", {v, h}, &w.embed});
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    LayerWeights& l = w.layers[static_cast<size_t>(i)];
    const std::string p = "model.layers." + std::to_string(i) + ".";
    out.push_back({p + "input_layernorm.weight", {h}, &l.input_norm});
    out.push_back({p + "self_attn.q_proj.weight", {qd, h}, &l.wq});
    if (c.attention_bias) out.push_back({p + "self_attn.q_proj.bias", {qd}, &l.bq});
    out.push_back({p + "self_attn.k_proj.weight", {kvd, h}, &l.wk});
    if (c.attention_bias) out.push_back({p + "self_attn.k_proj.bias", {kvd}, &l.bk});
    out.push_back({p + "self_attn.v_proj.weight", {kvd, h}, &l.wv});
    if (c.attention_bias) out.push_back({p + "self_attn.v_proj.bias", {kvd}, &l.bv});
    out.push_back({p + "self_attn.o_proj.weight", {h, qd}, &l.wo});
    if (c.o_proj_bias()) out.push_back({p + "self_attn.o_proj.bias", {h}, &l.bo});
    out.push_back({p + "post_attention_layernorm.weight", {h}, &l.post_norm});
    out.push_back({p + "mlp.gate_proj.weight", {inter, h}, &l.w_gate});
    out.push_back({p + "mlp.up_proj.weight", {inter, h}, &l.w_up});
    out.push_back({p + "mlp.down_proj.weight", {h, inter}, &l.w_down});
  }
  out.push_back({"model.norm.weight", {h}, &w.final_norm});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {v, h}, &w.lm_head});
  return out;
}

void check_checkpoint(const SafetensorsFolder& folder, const ModelConfig& config) {
  ModelWeights names;  // only for weight_tensors' names and shapes (no tensor is allocated)
  names.config = config;
  names.layers.resize(static_cast<size_t>(config.num_hidden_layers));
  const std::vector<WeightTensor> tensors = weight_tensors(names);
  // Presence first (in checkpoint order, so the first missing tensor is the one reported).
  std::set<std::string> expected;
  for (const WeightTensor& t : tensors) expected.insert(t.name);
  for (const WeightTensor& t : tensors) {
    if (folder.find(t.name) != nullptr) continue;
    std::string unused;
    int listed = 0;
    for (const std::string& n : folder.names()) {
      if (expected.count(n) || n == "lm_head.weight") continue;
      if (listed < 3) unused += std::string(listed ? ", " : "") + "'" + n + "'";
      ++listed;
    }
    FT_FAIL(folder.path() + ": missing tensor '" + t.name + "'" +
            (listed ? " (unused tensors in the checkpoint: " + unused + (listed > 3 ? ", ..." : "") + ")" : ""));
  }
  for (const WeightTensor& t : tensors) {
    const TensorView& v = folder.tensor(t.name);
    FT_CHECK(v.shape == t.shape, folder.file_of(t.name) + ": tensor '" + t.name + "' has shape " +
                                     shape_str(v.shape) + ", expected " + shape_str(t.shape) + " for this config");
  }
}

ModelWeights load_weights(const SafetensorsFolder& folder, const ModelConfig& config, int num_threads) {
  config.validate();
  check_cpu_size(config, "load_weights");
  check_checkpoint(folder, config);  // presence and shapes, before any allocation
  ModelWeights w;
  w.config = config;
  resize(w);
  std::vector<WeightTensor> tensors = weight_tensors(w);
  parallel_for(
      static_cast<int64_t>(tensors.size()),
      [&](int64_t i) {
        const WeightTensor& t = tensors[static_cast<size_t>(i)];
        *t.data = folder.to_f32(t.name, t.shape);
      },
      num_threads);
  return w;
}

ModelWeights random_weights(const ModelConfig& config, uint64_t seed) {
  config.validate();
  check_cpu_size(config, "random_weights");
  ModelWeights w;
  w.config = config;
  resize(w);
  std::mt19937_64 rng(seed);
  auto uniform = [&](float lo, float hi) {
    const float u = static_cast<float>(rng() >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
    return lo + (hi - lo) * u;
  };
  for (const WeightTensor& t : weight_tensors(w)) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    t.data->resize(static_cast<size_t>(numel));
    const bool is_norm = t.name.find("norm") != std::string::npos;
    const bool is_bias = t.name.ends_with(".bias");
    const bool is_embed = t.name == "model.embed_tokens.weight";
    float lo, hi, offset = 0.0f;
    if (is_norm) {
      lo = -0.1f, hi = 0.1f, offset = 1.0f;
    } else if (is_bias) {
      lo = -0.1f, hi = 0.1f;
    } else if (is_embed) {
      lo = -1.0f, hi = 1.0f;
    } else {
      const float a = static_cast<float>(std::sqrt(3.0 / static_cast<double>(t.shape[1])));
      lo = -a, hi = a;
    }
    for (float& x : *t.data) x = offset + uniform(lo, hi);
  }
  return w;
}

void save_weights(const ModelWeights& w, const std::string& path, DType dtype) {
  std::vector<SafetensorsTensor> out;
  for (const WeightTensor& t : weight_tensors(const_cast<ModelWeights&>(w)))  // read only
    out.push_back({t.name, dtype, t.shape, *t.data});
  write_safetensors(path, out, {{"format", "pt"}});
}

}  // namespace fasttree
