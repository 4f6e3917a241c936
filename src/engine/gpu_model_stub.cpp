// Built instead of gpu_model.cpp / gpu_weights.cpp when nvcc is absent: constructing a GpuModel
// reports that the CUDA backend is not built (the other members are unreachable).
#include "core/error.h"
#include "engine/gpu_model.h"

namespace fasttree {

namespace {

[[noreturn]] void not_built() {
  FT_FAIL("GPU model: this binary was built without the CUDA backend (no nvcc); use the CPU backend");
}

}  // namespace

struct GpuModel::Impl {};

GpuModel::GpuModel(const ModelWeights&, int32_t, GpuModelOptions) { not_built(); }
GpuModel::GpuModel(const ModelConfig&, uint64_t, int32_t, GpuModelOptions) { not_built(); }
GpuModel::GpuModel(const SafetensorsFolder&, const ModelConfig&, int32_t, GpuModelOptions) { not_built(); }
GpuModel::~GpuModel() = default;

const ModelConfig& GpuModel::config() const { not_built(); }
int32_t GpuModel::num_slots() const { not_built(); }
int GpuModel::kernel_head_dim() const { not_built(); }
int64_t GpuModel::weight_bytes() const { not_built(); }
int64_t GpuModel::kv_pool_bytes() const { not_built(); }
const Plan& GpuModel::last_plan() const { not_built(); }
std::vector<float> GpuModel::prefill(std::span<const int32_t>, std::span<const int32_t>, std::span<const int32_t>,
                                     std::span<const int32_t>, bool) {
  not_built();
}
std::vector<float> GpuModel::prefill_batch(std::span<const PrefillSeq>) { not_built(); }
std::vector<float> GpuModel::decode(const DecodeBatch&, DecodeAttention) { not_built(); }
std::vector<int32_t> GpuModel::decode_greedy(const DecodeBatch&, DecodeAttention) { not_built(); }
void GpuModel::set_profiling(bool) { not_built(); }
DecodeTimes GpuModel::decode_times() const { not_built(); }
void GpuModel::reset_times() { not_built(); }
std::vector<uint16_t> GpuModel::k_cache(int) const { not_built(); }
std::vector<uint16_t> GpuModel::v_cache(int) const { not_built(); }

}  // namespace fasttree
