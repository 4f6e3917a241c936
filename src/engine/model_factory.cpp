#include "engine/model_factory.h"

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "cuda/backend.h"
#include "engine/cpu_model.h"
#include "engine/gpu_model.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "engine/tp_cpu_model.h"
#include "engine/tp_gpu_model.h"
#include "engine/tp_shard.h"
#include "engine/weights.h"

namespace fasttree {

namespace {

std::unique_ptr<DecoderModel> make_gpu_model(const ModelSpec& spec) {
  FT_CHECK(cuda_backend_built(), "--backend cuda: this binary was built without the CUDA backend (no nvcc)");
  if (spec.tp > 1) {
    const int visible = cuda_device_count();
    FT_CHECK(visible >= spec.tp, "--tp " + std::to_string(spec.tp) + " needs " + std::to_string(spec.tp) +
                                     " GPUs, but " + std::to_string(visible) + " CUDA device" +
                                     (visible == 1 ? " is" : "s are") + " visible");
  }
  FT_CHECK(cuda_device_count() > 0, "--backend cuda: no CUDA device is present");
  GpuModelOptions options;
  options.planner = spec.planner;
  const auto slots = static_cast<int32_t>(spec.kv_slots);
  if (spec.tp > 1) {
    TpGpuModelOptions tp_options;
    tp_options.tp = spec.tp;
    tp_options.model = options;
    if (!spec.model_dir.empty()) {
      const ModelConfig config = load_model_config(spec.model_dir);
      const SafetensorsFolder folder(spec.model_dir);
      return std::make_unique<TpGpuModel>(folder, config, slots, tp_options);
    }
    return std::make_unique<TpGpuModel>(model_preset(spec.preset), spec.weights_seed, slots, tp_options);
  }
  if (!spec.model_dir.empty()) {
    const ModelConfig config = load_model_config(spec.model_dir);
    const SafetensorsFolder folder(spec.model_dir);
    return std::make_unique<GpuModel>(folder, config, slots, options);
  }
  return std::make_unique<GpuModel>(model_preset(spec.preset), spec.weights_seed, slots, options);
}

}  // namespace

std::unique_ptr<DecoderModel> make_model(const ModelSpec& spec) {
  FT_CHECK(spec.backend == "cpu" || spec.backend == "cuda", "--backend must be cpu or cuda, got '" + spec.backend + "'");
  FT_CHECK(spec.model_dir.empty() != spec.preset.empty(), "give exactly one of --model DIR and --preset NAME");
  FT_CHECK(spec.kv_slots > 0 && spec.kv_slots <= INT32_MAX,
           "KV pool size must be in [1, 2^31) tokens, got " + std::to_string(spec.kv_slots));
  if (!spec.model_dir.empty()) {
    std::error_code ec;
    FT_CHECK(std::filesystem::is_directory(spec.model_dir, ec), "--model " + spec.model_dir + ": no such folder");
  }
  FT_CHECK(spec.tp >= 1, "--tp must be at least 1, got " + std::to_string(spec.tp));
  if (spec.tp > 1) {  // the split is checked before any weights are made
    const ModelConfig config = spec.model_dir.empty() ? model_preset(spec.preset) : load_model_config(spec.model_dir);
    check_tp(config, spec.tp);
  }
  if (spec.backend == "cuda") return make_gpu_model(spec);
  ModelWeights weights;
  if (!spec.model_dir.empty()) {
    const ModelConfig config = load_model_config(spec.model_dir);
    const SafetensorsFolder folder(spec.model_dir);
    weights = load_weights(folder, config, spec.threads);
  } else {
    weights = random_weights(model_preset(spec.preset), spec.weights_seed);
  }
  if (spec.tp > 1) {
    TpCpuModelOptions to;
    to.tp = spec.tp;
    to.threads_per_rank = spec.threads > 0 ? std::max(1, spec.threads / spec.tp) : 0;
    to.planner = spec.planner;
    return std::make_unique<TpCpuModel>(weights, static_cast<int32_t>(spec.kv_slots), to);
  }
  CpuModelOptions mo;
  mo.num_threads = spec.threads;
  mo.planner = spec.planner;
  return std::make_unique<CpuModel>(std::move(weights), static_cast<int32_t>(spec.kv_slots), mo);
}

}  // namespace fasttree
