// ModelWeights (engine/weights.h): seeded random init, save -> load round trips (F32 exact, BF16
// rounded), HF checkpoint folders (config.json + safetensors), and every missing / misnamed /
// misshaped / wrongly typed tensor -> an error naming it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/half.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "engine/safetensors_writer.h"
#include "engine/weights.h"
#include "engine_test_util.h"

namespace fasttree {
namespace {

using test::expect_error;
using test::TempDir;

ModelConfig qwen_tiny() {
  ModelConfig c = model_preset("tiny");
  c.model_type = "qwen2";
  c.attention_bias = true;
  c.tie_word_embeddings = true;
  c.num_key_value_heads = 1;
  c.vocab_size = 96;
  return c;
}

// Checkpoint tensors of `w` (optionally dropping / renaming / reshaping one) for hand-made files.
std::vector<SafetensorsTensor> tensors_of(ModelWeights& w) {
  std::vector<SafetensorsTensor> out;
  for (const WeightTensor& t : weight_tensors(w)) out.push_back({t.name, DType::kF32, t.shape, *t.data});
  return out;
}

void expect_equal_weights(ModelWeights& a, ModelWeights& b) {
  auto ta = weight_tensors(a), tb = weight_tensors(b);
  ASSERT_EQ(ta.size(), tb.size());
  for (size_t i = 0; i < ta.size(); ++i) {
    EXPECT_EQ(ta[i].name, tb[i].name);
    EXPECT_TRUE(*ta[i].data == *tb[i].data) << ta[i].name;
  }
}

ModelConfig llama_bias_tiny() {
  ModelConfig c = model_preset("tiny");
  c.attention_bias = true;
  return c;
}

TEST(EngineWeights, RandomInitIsSeededAndScaled) {
  const ModelConfig c = model_preset("tiny");
  ModelWeights a = random_weights(c, 42), b = random_weights(c, 42), d = random_weights(c, 43);
  expect_equal_weights(a, b);
  EXPECT_NE(a.layers[0].wq, d.layers[0].wq);
  int64_t total = 0;
  for (const WeightTensor& t : weight_tensors(a)) {
    total += static_cast<int64_t>(t.data->size());
    double sum_sq = 0;
    for (float x : *t.data) sum_sq += static_cast<double>(x) * x;
    const double rms = std::sqrt(sum_sq / static_cast<double>(t.data->size()));
    if (t.name.find("norm") != std::string::npos) {
      EXPECT_NEAR(rms, 1.0, 0.05) << t.name;
    } else if (t.name != "model.embed_tokens.weight") {
      EXPECT_NEAR(rms, 1.0 / std::sqrt(static_cast<double>(t.shape[1])), 0.2 / std::sqrt(t.shape[1])) << t.name;
    }
  }
  EXPECT_EQ(total, c.num_params());
  EXPECT_TRUE(a.lm_head.size() == static_cast<size_t>(c.vocab_size * c.hidden_size));
  EXPECT_TRUE(a.layers[0].bq.empty());
  ModelWeights q = random_weights(qwen_tiny(), 1);
  EXPECT_TRUE(q.lm_head.empty());
  EXPECT_EQ(q.output_weight().data(), q.embed.data());
  EXPECT_EQ(q.layers[1].bk.size(), static_cast<size_t>(qwen_tiny().kv_dim()));
  EXPECT_TRUE(q.layers[1].bo.empty());  // qwen2: no o_proj bias
  ModelWeights lb = random_weights(llama_bias_tiny(), 1);
  EXPECT_EQ(lb.layers[0].bo.size(), 64u);  // llama with attention_bias: o_proj bias too
  EXPECT_EQ(lb.layers[0].bq.size(), 64u);
  expect_error([] { random_weights(model_preset("llama2-7b"), 0); }, {"random_weights", "6738415616 parameters"});
}

TEST(EngineWeights, SaveLoadRoundTrip) {
  TempDir dir;
  for (const ModelConfig& c : {model_preset("tiny"), qwen_tiny(), llama_bias_tiny()}) {
    ModelWeights w = random_weights(c, 7);
    save_weights(w, dir.path("model.safetensors"));
    dir.write("config.json", model_config_to_json(c));
    const ModelConfig loaded_config = load_model_config(dir.path());
    EXPECT_EQ(loaded_config, c);
    SafetensorsFolder folder(dir.path());
    ModelWeights loaded = load_weights(folder, loaded_config, 2);
    expect_equal_weights(loaded, w);

    save_weights(w, dir.path("model.safetensors"), DType::kBF16);
    SafetensorsFolder bf(dir.path());
    EXPECT_EQ(bf.tensor("model.norm.weight").dtype, DType::kBF16);
    ModelWeights lb = load_weights(bf, c);
    auto tw = weight_tensors(w), tl = weight_tensors(lb);
    for (size_t i = 0; i < tw.size(); ++i)
      for (size_t j = 0; j < tw[i].data->size(); ++j)
        ASSERT_EQ((*tl[i].data)[j], bf16_to_float(float_to_bf16((*tw[i].data)[j]))) << tw[i].name;
  }
  // A tied model ignores an lm_head.weight that the checkpoint happens to carry.
  ModelWeights q = random_weights(qwen_tiny(), 3);
  auto t = tensors_of(q);
  const std::vector<float> extra(static_cast<size_t>(qwen_tiny().vocab_size * 64), 0.5f);
  t.push_back({"lm_head.weight", DType::kF32, {qwen_tiny().vocab_size, 64}, extra});
  write_safetensors(dir.path("model.safetensors"), t);
  ModelWeights lq = load_weights(SafetensorsFolder(dir.path()), qwen_tiny());
  EXPECT_TRUE(lq.lm_head.empty());
}

TEST(EngineWeights, BadCheckpointsNameTheTensor) {
  TempDir dir;
  const ModelConfig c = model_preset("tiny");
  ModelWeights w = random_weights(c, 9);
  const std::string file = dir.path("model.safetensors");
  auto load = [&](const ModelConfig& cfg) { load_weights(SafetensorsFolder(dir.path()), cfg); };

  // Missing.
  auto t = tensors_of(w);
  std::erase_if(t, [](const SafetensorsTensor& x) { return x.name == "model.layers.1.mlp.up_proj.weight"; });
  write_safetensors(file, t);
  expect_error([&] { load(c); }, {dir.path(), "missing tensor 'model.layers.1.mlp.up_proj.weight'"}, "missing");

  // Misnamed: reported as missing, with the unused (likely misnamed) tensor listed.
  t = tensors_of(w);
  for (auto& x : t)
    if (x.name == "model.layers.0.self_attn.k_proj.weight") x.name = "model.layers.0.attn.k_proj.weight";
  write_safetensors(file, t);
  expect_error([&] { load(c); },
               {"missing tensor 'model.layers.0.self_attn.k_proj.weight'", "unused tensors in the checkpoint",
                "'model.layers.0.attn.k_proj.weight'"},
               "misnamed");

  // Misshaped: gate_proj stored transposed.
  t = tensors_of(w);
  for (auto& x : t)
    if (x.name == "model.layers.1.mlp.gate_proj.weight") x.shape = {c.hidden_size, c.intermediate_size};
  write_safetensors(file, t);
  expect_error([&] { load(c); },
               {file, "tensor 'model.layers.1.mlp.gate_proj.weight'", "[64, 128]", "expected [128, 64]"}, "shape");

  // Wrongly typed: an integer tensor where a weight should be.
  t = tensors_of(w);
  std::erase_if(t, [](const SafetensorsTensor& x) { return x.name == "model.norm.weight"; });
  write_safetensors(file, t);
  {
    // An I64 "model.norm.weight" in a second shard.
    std::string header = R"({"model.norm.weight": {"dtype": "I64", "shape": [64], "data_offsets": [0, 512]}})";
    std::string bytes(8, '\0');
    const uint64_t len = header.size();
    std::memcpy(bytes.data(), &len, 8);
    dir.write("model-2.safetensors", bytes + header + std::string(512, '\x02'));
  }
  expect_error([&] { load(c); }, {"model-2.safetensors", "tensor 'model.norm.weight'", "dtype I64 is not supported"},
               "dtype");
  std::filesystem::remove(dir.path("model-2.safetensors"));

  // Missing lm_head for an untied model; missing bias for a biased model.
  t = tensors_of(w);
  std::erase_if(t, [](const SafetensorsTensor& x) { return x.name == "lm_head.weight"; });
  write_safetensors(file, t);
  expect_error([&] { load(c); }, {"missing tensor 'lm_head.weight'"}, "lm_head");
  ModelConfig biased = c;
  biased.attention_bias = true;
  write_safetensors(file, tensors_of(w));
  expect_error([&] { load(biased); }, {"missing tensor 'model.layers.0.self_attn.q_proj.bias'"}, "bias");
  // Config mismatch: a checkpoint of another size.
  ModelConfig wider = c;
  wider.intermediate_size = 96;
  expect_error([&] { load(wider); }, {"tensor 'model.layers.0.mlp.gate_proj.weight'", "[128, 64]", "[96, 64]"},
               "config mismatch");
  ModelConfig huge = model_preset("llama3-8b");
  expect_error([&] { load(huge); }, {"load_weights", "parameters"}, "too big");
}

}  // namespace
}  // namespace fasttree
