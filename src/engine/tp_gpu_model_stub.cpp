// Built instead of tp_gpu_model.cpp when nvcc is absent: constructing a TpGpuModel checks the
// tensor-parallel split (the same Error as the GPU build) and then reports that the CUDA backend
// is not built (the other members are unreachable).
#include "core/error.h"
#include "engine/tp_gpu_model.h"
#include "engine/tp_shard.h"

namespace fasttree {

namespace {

[[noreturn]] void not_built(int tp) {
  FT_FAIL("tensor parallelism on GPUs (tp " + std::to_string(tp) +
          "): this binary was built without the CUDA backend (no nvcc); use the CPU backend");
}

}  // namespace

struct TpGpuModel::Impl {};

TpGpuModel::TpGpuModel(const ModelWeights& weights, int32_t, TpGpuModelOptions options) {
  check_tp(weights.config, options.tp);
  not_built(options.tp);
}
TpGpuModel::TpGpuModel(const SafetensorsFolder&, const ModelConfig& config, int32_t, TpGpuModelOptions options) {
  check_tp(config, options.tp);
  not_built(options.tp);
}
TpGpuModel::TpGpuModel(const ModelConfig& config, uint64_t, int32_t, TpGpuModelOptions options) {
  check_tp(config, options.tp);
  not_built(options.tp);
}
TpGpuModel::~TpGpuModel() = default;

const ModelConfig& TpGpuModel::config() const { not_built(0); }
int32_t TpGpuModel::num_slots() const { not_built(0); }
int TpGpuModel::tp() const { not_built(0); }
const ModelConfig& TpGpuModel::local_config() const { not_built(0); }
const Plan& TpGpuModel::last_plan() const { not_built(0); }
std::vector<float> TpGpuModel::prefill(std::span<const int32_t>, std::span<const int32_t>, std::span<const int32_t>,
                                       std::span<const int32_t>, bool) {
  not_built(0);
}
std::vector<float> TpGpuModel::prefill_batch(std::span<const PrefillSeq>) { not_built(0); }
std::vector<float> TpGpuModel::decode(const DecodeBatch&, DecodeAttention) { not_built(0); }
std::vector<int32_t> TpGpuModel::decode_greedy(const DecodeBatch&, DecodeAttention) { not_built(0); }
void TpGpuModel::set_profiling(bool) { not_built(0); }
DecodeTimes TpGpuModel::decode_times() const { not_built(0); }
void TpGpuModel::reset_times() { not_built(0); }
const std::string& TpGpuModel::all_reduce_path() const { not_built(0); }
const std::vector<std::string>& TpGpuModel::last_rank_errors() const { not_built(0); }
int64_t TpGpuModel::replica_mismatches() const { not_built(0); }

}  // namespace fasttree
