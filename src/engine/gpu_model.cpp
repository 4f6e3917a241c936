#include "engine/gpu_model.h"

#include "engine/gpu_model_impl.h"

namespace fasttree {

GpuModel::GpuModel(const ModelWeights& weights, int32_t num_slots, GpuModelOptions options)
    : impl_(std::make_unique<Impl>(
          [&](CUstream_st* s) {
            if (options.tp_size == 1) return upload_gpu_weights(weights, s);
            return upload_gpu_weights(shard_weights(weights, options.tp_rank, options.tp_size), s);
          },
          num_slots, options)) {}

GpuModel::GpuModel(const ModelConfig& config, uint64_t seed, int32_t num_slots, GpuModelOptions options)
    : impl_(std::make_unique<Impl>(
          [&](CUstream_st* s) { return random_gpu_weights_shard(config, seed, options.tp_rank, options.tp_size, s); },
          num_slots, options)) {}

GpuModel::GpuModel(const SafetensorsFolder& folder, const ModelConfig& config, int32_t num_slots,
                   GpuModelOptions options)
    : impl_(std::make_unique<Impl>(
          [&](CUstream_st* s) { return load_gpu_weights_shard(folder, config, options.tp_rank, options.tp_size, s); },
          num_slots, options)) {}

GpuModel::~GpuModel() {
  if (impl_ && impl_->host_timing && impl_->host_steps > 0) {
    const double n = static_cast<double>(impl_->host_steps);
    std::fprintf(stderr, "gpu model host timing: %lld decode steps, per step: checks %.3f ms, enqueue %.3f ms, wait %.3f ms\n",
                 static_cast<long long>(impl_->host_steps), impl_->host_ms[0] / n, impl_->host_ms[1] / n,
                 impl_->host_ms[2] / n);
  }
}

const ModelConfig& GpuModel::config() const { return impl_->config; }
int32_t GpuModel::num_slots() const { return impl_->num_slots; }
int GpuModel::kernel_head_dim() const { return impl_->dk; }
int64_t GpuModel::weight_bytes() const { return static_cast<int64_t>(impl_->weights.bytes()); }
int64_t GpuModel::kv_pool_bytes() const { return static_cast<int64_t>(impl_->kv.bytes()); }
const Plan& GpuModel::last_plan() const { return impl_->plan; }

std::vector<float> GpuModel::decode(const DecodeBatch& batch, DecodeAttention attention) {
  Impl& m = *impl_;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t b = m.check_decode(batch, attention);
  if (b == 0) return {};
  const int64_t vocab = m.config.vocab_size;
  std::vector<float> out(static_cast<size_t>(b * vocab));
  m.guarded([&] {
    m.enqueue_decode(batch, b, [&](int64_t r, int64_t mr) {
      m.wait_device();  // the copy to pageable memory blocks the host
      copy_to_host(out.data() + r * vocab, m.logits.data(), static_cast<size_t>(mr * vocab) * 4, m.s());
    });
    m.finish_decode(t0);
  });
  return out;
}

std::vector<int32_t> GpuModel::decode_greedy(const DecodeBatch& batch, DecodeAttention attention) {
  Impl& m = *impl_;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t b = m.check_decode(batch, attention);
  if (b == 0) return {};
  const auto t1 = std::chrono::steady_clock::now();
  std::vector<int32_t> out(static_cast<size_t>(b));
  m.guarded([&] {
    const int32_t* d = m.prepare_decode(batch, b);
    auto body = [&] {
      m.enqueue_decode_body(d, b, [&](int64_t r, int64_t mr) {
        cuda_ops::argmax_rows(m.logits.as<float>(), static_cast<int>(mr), m.config.vocab_size,
                              m.ids.as<int32_t>() + r, m.s());
      });
      copy_to_host(m.ids_host.data(), m.ids.data(), static_cast<size_t>(b) * 4, m.s());
    };
    // Tensor parallelism: each rank captures its own graph, NCCL all-reduces included (every rank
    // takes the same capture / replay decision at the same step, so the collectives stay matched);
    // not with a before_all_reduce hook (tests count and fail individual all-reduces).
    if (m.options.decode_graphs && m.graphs_allowed && !m.marking && !m.options.tp.before_all_reduce) {
      // Everything the captured step depends on: batch size, the plan buffers' epoch, every buffer
      // the body touches (they only move when they grow).
      const Impl::GraphKey key{b, m.attention->graph_epoch(), d, m.rows_cap, m.lm_rows_cap, m.resid.data()};
      if (m.graph.valid() && key == m.graph_key) {
        m.graph.launch(m.s());
      } else if (key == m.last_graph_key) {  // second step like this one: capture, then replay
        m.graph.capture(m.s(), body);
        m.graph_key = key;
        m.graph.launch(m.s());
      } else {
        body();
      }
      m.last_graph_key = key;
    } else {
      body();
    }
    const auto t2 = std::chrono::steady_clock::now();
    m.finish_decode(t0);
    std::copy_n(m.ids_host.as<int32_t>(), b, out.begin());
    if (m.host_timing) {  // FT_HOST_TIMING=1: host-side split of decode steps (diagnostics)
      const auto t3 = std::chrono::steady_clock::now();
      m.host_ms[0] += std::chrono::duration<double, std::milli>(t1 - t0).count();
      m.host_ms[1] += std::chrono::duration<double, std::milli>(t2 - t1).count();
      m.host_ms[2] += std::chrono::duration<double, std::milli>(t3 - t2).count();
      ++m.host_steps;
    }
  });
  return out;
}

void GpuModel::set_profiling(bool on) { impl_->profiling = on; }
DecodeTimes GpuModel::decode_times() const { return impl_->times; }
void GpuModel::reset_times() { impl_->times = {}; }

std::vector<uint16_t> GpuModel::k_cache(int layer) const {
  Impl& m = *impl_;
  FT_CHECK(layer >= 0 && layer < m.config.num_hidden_layers, "k_cache: no layer " + num(layer));
  std::vector<uint16_t> out(static_cast<size_t>(m.pool_elems));
  copy_to_host(out.data(), m.k_pool(layer), out.size() * 2, m.s());
  m.stream.synchronize();
  return out;
}

std::vector<uint16_t> GpuModel::v_cache(int layer) const {
  Impl& m = *impl_;
  FT_CHECK(layer >= 0 && layer < m.config.num_hidden_layers, "v_cache: no layer " + num(layer));
  std::vector<uint16_t> out(static_cast<size_t>(m.pool_elems));
  copy_to_host(out.data(), m.v_pool(layer), out.size() * 2, m.s());
  m.stream.synchronize();
  return out;
}

}  // namespace fasttree
