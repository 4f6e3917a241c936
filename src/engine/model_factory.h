// make_model: the engine's model for a command line — a HF checkpoint folder or a named preset with
// seeded random weights, on the CPU (fp32, engine/cpu_model.h) or the GPU (bf16, engine/gpu_model.h).
// Used by `fasttree generate` and `fasttree bench-e2e`. Every bad input is a one-line Error; with
// tp > 1 the split is checked (check_tp) before any weights are made or a device is touched.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "engine/model.h"
#include "plan/planner.h"

namespace fasttree {

struct ModelSpec {
  std::string model_dir;       // HF checkpoint folder (config.json + *.safetensors), or
  std::string preset;          // a named shape (model_preset) with random weights
  uint64_t weights_seed = 0;   // seed of the preset's random weights
  std::string backend = "cpu"; // cpu | cuda
  int64_t kv_slots = 0;        // KV pool size in tokens (> 0)
  int threads = 0;             // CPU threads (0 = all; with tp > 1 on the CPU: split over the ranks)
  int tp = 1;                  // tensor-parallel ranks: cuda -> TpGpuModel on GPUs 0..tp-1 (each rank reads
                               // only its blocks of a checkpoint); cpu -> TpCpuModel
  PlannerConfig planner = engine_planner_config();       // decode planning inside the model (when the scheduler brings no plan)
};

std::unique_ptr<DecoderModel> make_model(const ModelSpec& spec);

}  // namespace fasttree
