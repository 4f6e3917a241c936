// GpuModel::Impl (engine/gpu_model.h): the device state and the per-layer forward pass shared by
// gpu_model.cpp (construction, decode) and gpu_model_prefill.cpp (prefill, batched prefill).
// Internal to the engine layer; include only from those files.
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <tuple>

#include "core/error.h"
#include "cuda/backend.h"
#include "cuda/device.h"
#include "cuda/engine_ops.h"
#include "cuda/gemm.h"
#include "engine/gpu_model.h"
#include "engine/gpu_weights.h"
#include "engine/rope.h"
#include "engine/tp_shard.h"
#include "plan/plan_validate.h"

namespace fasttree {

namespace gpu_model_detail {

inline std::string num(int64_t v) { return std::to_string(v); }
inline std::string gib(double bytes) { return std::to_string(bytes / double(1 << 30)).substr(0, 6) + " GiB"; }

enum Phase { kAttention, kGemm, kOther, kComm, kNumPhases };

using Loader = std::function<GpuWeights(CUstream_st*)>;

inline bool check_args(int32_t num_slots, const GpuModelOptions& o) {
  FT_CHECK(cuda_backend_built(), "GPU model: this binary was built without the CUDA backend (no nvcc)");
  FT_CHECK(cuda_device_count() > 0, "GPU model: no CUDA device is present");
  FT_CHECK(num_slots >= 0, "GPU model: num_slots must be >= 0 (0 = as many as fit), got " + num(num_slots));
  FT_CHECK(o.prefill_chunk > 0, "GPU model: prefill_chunk must be positive, got " + num(o.prefill_chunk));
  FT_CHECK(o.kv_memory_fraction > 0 && o.kv_memory_fraction <= 1,
           "GPU model: kv_memory_fraction must be in (0, 1], got " + std::to_string(o.kv_memory_fraction));
  FT_CHECK(o.tp_size >= 1 && o.tp_rank >= 0 && o.tp_rank < o.tp_size,
           "GPU model: tensor-parallel rank " + num(o.tp_rank) + " outside [0, " + num(o.tp_size) + ")");
  FT_CHECK(o.tp_size == 1 || o.tp.all_reduce, "GPU model: tp_size > 1 needs an all-reduce hook");
  if (o.device >= 0) cuda_set_device(o.device);  // before the stream and every allocation
  return true;
}

}  // namespace gpu_model_detail

using namespace gpu_model_detail;

struct GpuModel::Impl {
  bool args_ok;
  CudaStream stream;  // declared early: destroyed after everything that enqueues on it
  GpuModelOptions options;
  GpuWeights weights;
  const ModelConfig& config;
  int dk;
  int32_t num_slots = 0;
  int64_t pool_elems = 0;  // per layer and K or V: num_slots * Hkv * dk
  Gemm gemm;
  DeviceBuffer kv;        // bf16 [L][K, V][num_slots, Hkv, dk]
  DeviceBuffer inv_freq;  // fp32 [dk / 2]
  std::unique_ptr<CudaTreeAttention> attention;
  Planner planner;
  Plan plan;

  // Activations (gpu_model.h), rows_cap rows each; logits lm_rows_cap rows.
  int64_t rows_cap = 0, lm_rows_cap = 0;
  int64_t call_rows = 0;  // activation rows of the current call (ensure_rows)
  DeviceBuffer resid, x, qkv, q, attn_f32, attn, delta, gate_up, act, logits;
  DeviceBuffer ints, ids;     // int32 inputs of a call; greedy ids [B]
  PinnedBuffer ints_host, ids_host;
  std::vector<int32_t> scratch;  // duplicate-slot checks
  DeviceBuffer x_last;           // prefill_batch: bf16 [kMaxLogitRows, h], the rows the LM head reads
  std::vector<int32_t> slot_writer;  // prefill_batch checks: sequence writing each slot, -1 none

  PhaseTimer timer{kNumPhases};
  int64_t reduce_index = 0;  // all-reduces of the current call (GpuTpHooks::before_all_reduce)
  bool profiling = false;
  bool marking = false;  // this call records phase events
  DecodeTimes times;

  Impl(const Loader& load, int32_t slots, const GpuModelOptions& opt)
      : args_ok(check_args(slots, opt)),
        options(opt),
        weights(load(stream.get())),
        config(weights.config()),
        dk(weights.kernel_head_dim()),
        gemm(stream.get()),
        planner(opt.planner) {
    const ModelConfig& c = config;
    // RoPE frequencies in the padded layout (gpu_weights.h): pairs beyond d/2 are padding (angle 0).
    const Rope rope(c);
    std::vector<float> freq(static_cast<size_t>(dk / 2), 0.0f);
    std::copy(rope.inv_freq().begin(), rope.inv_freq().end(), freq.begin());
    inv_freq.reserve(freq.size() * sizeof(float));
    copy_to_device(inv_freq.data(), freq.data(), freq.size() * sizeof(float), stream.get());

    const int64_t per_slot = gpu_kv_bytes_per_slot(c);
    const DeviceMemInfo mem = cuda_mem_info();
    const int64_t reserve = gpu_activation_bytes(c, opt.prefill_chunk);
    if (slots == 0) {
      slots = gpu_max_kv_slots(c, static_cast<int64_t>(mem.free_bytes), opt.kv_memory_fraction, opt.prefill_chunk);
      FT_CHECK(slots > 0, "GPU model: no room for a KV pool: " + num(static_cast<int64_t>(mem.free_bytes)) +
                              " bytes free after the weights, " + num(reserve) + " reserved for activations");
    }
    const double need = static_cast<double>(slots) * static_cast<double>(per_slot);
    FT_CHECK(need + static_cast<double>(reserve) <= static_cast<double>(mem.free_bytes),
             "GPU model: a KV pool of " + num(slots) + " slots needs " + num(static_cast<int64_t>(need)) + " bytes (" +
                 gib(need) + ") plus " + num(reserve) + " bytes for activations, but " +
                 num(static_cast<int64_t>(mem.free_bytes)) + " bytes (" + gib(static_cast<double>(mem.free_bytes)) +
                 ") of device memory are free after the weights (at most " +
                 num(gpu_max_kv_slots(c, static_cast<int64_t>(mem.free_bytes), 1.0, opt.prefill_chunk)) + " slots fit)");
    num_slots = slots;
    pool_elems = int64_t{slots} * c.num_key_value_heads * dk;
    kv.reserve(static_cast<size_t>(need));
    memset_device(kv.data(), 0, kv.bytes(), stream.get());  // like CpuModel: never-written slots read as 0

    attention = std::make_unique<CudaTreeAttention>(AttnShape{c.num_attention_heads, c.num_key_value_heads, dk},
                                                    KvDType::kBF16, c.attn_shape().default_sm_scale(),
                                                    opt.attention);
    stream.synchronize();
  }

  ~Impl() {
    try {
      stream.synchronize();
    } catch (...) {
    }
  }

  cuda_ops::Stream s() const { return stream.get(); }
  uint16_t* k_pool(int layer) const { return kv.as<uint16_t>() + (2 * int64_t{layer}) * pool_elems; }
  uint16_t* v_pool(int layer) const { return kv.as<uint16_t>() + (2 * int64_t{layer} + 1) * pool_elems; }
  int64_t qd() const { return int64_t{config.num_attention_heads} * dk; }
  int64_t qkv_dim() const { return int64_t{config.num_attention_heads + 2 * config.num_key_value_heads} * dk; }

  void mark(int phase) {
    if (marking) timer.mark(phase, s());
  }

  // The row-parallel GEMMs' fp32 output [rows, h] of the current call (ensure_rows' rows): the
  // tensor-parallel reduce buffer when the call fits in it, else the model's own.
  float* delta_f32() const {
    const size_t need = static_cast<size_t>(call_rows) * static_cast<size_t>(config.hidden_size) * 4;
    if (options.tp.reduce_buffer != nullptr && need <= options.tp.reduce_buffer_bytes) return options.tp.reduce_buffer;
    return delta.as<float>();
  }
  // Tensor parallelism: sums rows [0, m) of delta over the ranks (no-op on one GPU).
  void all_reduce_delta(int m) {
    if (!options.tp.all_reduce) return;
    if (options.tp.before_all_reduce) options.tp.before_all_reduce(reduce_index);
    ++reduce_index;
    options.tp.all_reduce(delta_f32(), static_cast<size_t>(m) * static_cast<size_t>(config.hidden_size), s());
    mark(kComm);
  }

  // Waits for the stream through the TP hook (timeout, peer failures) before anything blocking.
  void wait_device() {
    if (options.tp.wait) options.tp.wait(s());
  }
  void sync() {
    wait_device();
    stream.synchronize();
  }

  // Grows the activation buffers to `rows` rows and the logits to `lm_rows` rows.
  void ensure_rows(int64_t rows, int64_t lm_rows) {
    const ModelConfig& c = config;
    call_rows = rows;
    if (rows > rows_cap) {
      int64_t cap = std::max(rows, std::min<int64_t>(2 * rows_cap, options.prefill_chunk));
      cap = (cap + 15) / 16 * 16;
      const size_t n = static_cast<size_t>(cap), h = static_cast<size_t>(c.hidden_size);
      const size_t inter = static_cast<size_t>(c.intermediate_size);
      resid.reserve(n * h * 4);
      x.reserve(n * h * 2);
      qkv.reserve(n * static_cast<size_t>(qkv_dim()) * 4);
      q.reserve(n * static_cast<size_t>(qd()) * 2);
      attn_f32.reserve(n * static_cast<size_t>(qd()) * 4);
      attn.reserve(n * static_cast<size_t>(qd()) * 2);
      delta.reserve(n * h * 4);
      gate_up.reserve(n * 2 * inter * 2);
      act.reserve(n * inter * 2);
      ids.reserve(n * 4);
      ids_host.reserve(n * 4);
      rows_cap = cap;
    }
    lm_rows = std::min<int64_t>(lm_rows, kMaxLogitRows);
    if (lm_rows > lm_rows_cap) {
      const int64_t cap = std::max(lm_rows, std::min<int64_t>(2 * lm_rows_cap, kMaxLogitRows));
      logits.reserve(static_cast<size_t>(cap * config.vocab_size) * 4);
      lm_rows_cap = cap;
    }
  }

  // Copies the int32 inputs of a call (concatenated) to `ints` on the stream.
  const int32_t* upload_ints(std::initializer_list<std::span<const int32_t>> parts) {
    size_t total = 0;
    for (auto p : parts) total += p.size();
    ints_host.reserve(total * 4);
    ints.reserve(total * 4);
    int32_t* h = ints_host.as<int32_t>();
    for (auto p : parts) h = std::copy(p.begin(), p.end(), h);
    copy_to_device(ints.data(), ints_host.data(), total * 4, s());
    return ints.as<int32_t>();
  }

  // The decoder layers over rows [0, m) of resid; attend(layer) turns q into attn (bf16).
  void run_layers(int m, const int32_t* pos, const int32_t* slots, const std::function<void(int)>& attend) {
    const ModelConfig& c = config;
    const float eps = static_cast<float>(c.rms_norm_eps);
    const int64_t h = c.hidden_size, inter = c.intermediate_size;
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      const GpuLayerWeights& w = weights.layers[static_cast<size_t>(l)];
      cuda_ops::add_rms_norm(resid.as<float>(), l == 0 ? nullptr : delta_f32(), w.input_norm, eps, m, h,
                             x.as<uint16_t>(), s());
      mark(kOther);
      gemm.linear(x.as<uint16_t>(), w.w_qkv, m, qkv_dim(), h, qkv.as<float>());
      mark(kGemm);
      cuda_ops::rope_qkv_append(qkv.as<float>(), w.b_qkv, pos, slots, m, c.num_attention_heads, c.num_key_value_heads,
                                dk, inv_freq.as<float>(), q.as<uint16_t>(), k_pool(l), v_pool(l), s());
      mark(kOther);
      attend(l);
      gemm.linear(attn.as<uint16_t>(), w.w_o, m, h, qd(), delta_f32());
      mark(kGemm);
      if (w.b_o != nullptr) {  // tensor parallelism: rank 0's bias only (zeros elsewhere), before the sum
        cuda_ops::add_bias(delta_f32(), w.b_o, m, h, s());
        mark(kOther);
      }
      all_reduce_delta(m);
      cuda_ops::add_rms_norm(resid.as<float>(), delta_f32(), w.post_norm, eps, m, h, x.as<uint16_t>(), s());
      mark(kOther);
      gemm.linear(x.as<uint16_t>(), w.w_gate_up, m, 2 * inter, h, gate_up.as<uint16_t>());
      mark(kGemm);
      cuda_ops::silu_mul(gate_up.as<uint16_t>(), m, inter, act.as<uint16_t>(), s());
      mark(kOther);
      gemm.linear(act.as<uint16_t>(), w.w_down, m, h, inter, delta_f32());
      mark(kGemm);
      all_reduce_delta(m);
    }
  }

  // Final norm (adding the last layer's delta) and LM head of rows [first, first + rows), in pieces
  // of at most kMaxLogitRows rows: take(row offset from `first`, piece rows) consumes `logits`.
  void lm_head(int64_t first, int64_t rows, const std::function<void(int64_t, int64_t)>& take) {
    const ModelConfig& c = config;
    const int64_t h = c.hidden_size;
    cuda_ops::add_rms_norm(resid.as<float>() + first * h, delta_f32() + first * h, weights.final_norm,
                           static_cast<float>(c.rms_norm_eps), static_cast<int>(rows), h, x.as<uint16_t>() + first * h,
                           s());
    mark(kOther);
    for (int64_t r = 0; r < rows; r += kMaxLogitRows) {
      const int64_t mr = std::min<int64_t>(kMaxLogitRows, rows - r);
      gemm.linear(x.as<uint16_t>() + (first + r) * h, weights.lm_head, mr, c.vocab_size, h, logits.as<float>());
      mark(kGemm);
      take(r, mr);
      mark(kOther);
    }
  }

  // Runs f (device work); on an exception, waits for what was enqueued before rethrowing, so the
  // staging buffers are free for the next call.
  template <class F>
  auto guarded(F&& f) {
    try {
      return f();
    } catch (...) {
      marking = false;
      if (options.tp.on_error) options.tp.on_error();  // stops pending collectives first
      try {
        stream.synchronize();
      } catch (...) {
      }
      throw;
    }
  }

  void check_tokens(std::span<const int32_t> tokens, std::span<const int32_t> positions, std::span<const int32_t> slots,
                    const char* what) {
    const std::string w(what);
    FT_CHECK(positions.size() == tokens.size(), w + ": " + num(static_cast<int64_t>(tokens.size())) + " tokens but " +
                                                    num(static_cast<int64_t>(positions.size())) + " positions");
    FT_CHECK(slots.size() == tokens.size(), w + ": " + num(static_cast<int64_t>(tokens.size())) + " tokens but " +
                                                num(static_cast<int64_t>(slots.size())) + " slots");
    auto row = [](size_t i) { return " (row " + num(static_cast<int64_t>(i)) + ")"; };  // messages only
    for (size_t i = 0; i < tokens.size(); ++i) {
      FT_CHECK(tokens[i] >= 0 && tokens[i] < config.vocab_size,
               w + ": token " + num(tokens[i]) + row(i) + " outside the vocabulary [0, " + num(config.vocab_size) + ")");
      FT_CHECK(positions[i] >= 0, w + ": negative position " + num(positions[i]) + row(i));
      FT_CHECK(slots[i] >= 0 && slots[i] < num_slots,
               w + ": slot " + num(slots[i]) + row(i) + " out of range [0, " + num(num_slots) + ")");
    }
    check_distinct(slots, {}, w);
  }

  // No slot twice in a ++ b.
  void check_distinct(std::span<const int32_t> a, std::span<const int32_t> b, const std::string& what) {
    scratch.assign(a.begin(), a.end());
    scratch.insert(scratch.end(), b.begin(), b.end());
    std::sort(scratch.begin(), scratch.end());
    auto dup = std::adjacent_find(scratch.begin(), scratch.end());
    FT_CHECK(dup == scratch.end(), what + ": slot " + (dup == scratch.end() ? "" : num(*dup)) + " is " +
                                       (b.empty() ? "written by two tokens" : "used twice in context_slots ++ slots"));
  }

  // Validates a decode batch like CpuModel::decode; returns its size.
  int64_t check_decode(const DecodeBatch& batch, DecodeAttention attention_kind) {
    FT_CHECK(attention_kind == DecodeAttention::kFastTree,
             "decode: reference attention runs on the CPU model only (the GPU model runs FastTree attention)");
    FT_CHECK(batch.tree != nullptr, "decode: batch has no tree");
    check_tokens(batch.tokens, batch.positions, batch.slots, "decode");
    return check_decode_tree(batch, config, num_slots);
  }

  // Enqueues a decode step up to the logits; take(row, rows) consumes each LM-head piece.
  void enqueue_decode(const DecodeBatch& batch, int64_t b, const std::function<void(int64_t, int64_t)>& take) {
    const int32_t* d = prepare_decode(batch, b);
    enqueue_decode_body(d, b, take);
  }

  // Plans (when the batch brings no plan), grows buffers, uploads the plan and the step's inputs.
  const int32_t* prepare_decode(const DecodeBatch& batch, int64_t b) {
    const KvTree& tree = *batch.tree;
    const Plan* p = batch.plan;
    if (p == nullptr) {
      planner.build(tree, config.attn_shape(), plan);
      p = &plan;
    } else if (options.validate_plans) {
      validate_plan(*p, tree);
    }
    ensure_rows(b, b);
    reduce_index = 0;
    marking = profiling;
    if (marking) timer.begin(s());
    attention->upload(*p, tree, s(), num_slots);
    return upload_ints({batch.tokens, batch.positions, batch.slots});
  }

  // The step's device work from the embedding to the LM head (capturable: no host sync inside).
  void enqueue_decode_body(const int32_t* d, int64_t b, const std::function<void(int64_t, int64_t)>& take) {
    const int m = static_cast<int>(b);
    cuda_ops::embed(d, m, weights.embed, config.vocab_size, config.hidden_size, resid.as<float>(), s());
    mark(kOther);
    run_layers(m, d + b, d + 2 * b, [&](int l) {
      attention->run(q.data(), k_pool(l), v_pool(l), attn_f32.as<float>(), nullptr, s());
      mark(kAttention);
      cuda_ops::f32_to_bf16(attn_f32.as<float>(), b * qd(), attn.as<uint16_t>(), s());
      mark(kOther);
    });
    lm_head(0, b, take);
  }

  // Decode-step CUDA graph (GpuModelOptions::decode_graphs).
  using GraphKey = std::tuple<int64_t, uint64_t, const int32_t*, int64_t, int64_t, const void*>;
  CudaGraph graph;
  GraphKey graph_key{}, last_graph_key{};
  const bool graphs_allowed = [] {
    const char* e = std::getenv("FT_DECODE_GRAPHS");
    return e == nullptr || std::string(e) != "0";
  }();

  // FT_HOST_TIMING=1: per decode_greedy step, host ms in [checks, enqueue incl. plan upload, wait
  // for the device], printed to stderr when the model is destroyed.
  const bool host_timing = [] {
    const char* e = std::getenv("FT_HOST_TIMING");
    return e != nullptr && std::string(e) == "1";
  }();
  double host_ms[3] = {};
  int64_t host_steps = 0;

  void finish_decode(std::chrono::steady_clock::time_point t0) {
    sync();
    if (marking) {
      double ms[kNumPhases] = {};
      timer.collect(ms);
      times.attention_ms += ms[kAttention];
      times.gemm_ms += ms[kGemm];
      times.other_ms += ms[kOther];
      times.comm_ms += ms[kComm];
    }
    marking = false;
    ++times.steps;
    times.total_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
};

}  // namespace fasttree
