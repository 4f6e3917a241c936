// GpuModel: bf16 forward pass of a Llama-family decoder on one CUDA device — the DecoderModel
// (engine/model.h) of the GPU path, with CpuModel (engine/cpu_model.h) as its semantic reference:
// the same inputs are accepted and rejected with the same checks (token out of vocab, slot out of
// range or written twice, size mismatches, a query's path not ending at its slot, a context beyond
// the sliding window), every bad input a one-line fasttree::Error before any device work.
//
// Device state (no CUDA header here; everything enqueues on the model's own stream):
//   weights   engine/gpu_weights.h: bf16 [out, in] matrices with fused W_qkv [qd + 2 kvd, h] and
//             W_gate_up [2 I, h], fp32 biases, head dim padded to a kernel size (16 -> 64).
//   KV pool   bf16, one allocation: layer l's K then V, each [num_slots, Hkv, dk].
//   activations, sized for max(decode batch, prefill chunk) rows and grown only when a call needs
//             more: residual stream fp32 [n, h]; normed x bf16 [n, h]; qkv fp32 [n, qd + 2 kvd];
//             q bf16 [n, Hq, dk]; attention out fp32 (decode) and bf16 [n, Hq, dk]; delta fp32
//             [n, h]; gate_up bf16 [n, 2 I]; act bf16 [n, I]; logits fp32 [rows, V].
// Per layer (cuda/engine_ops.h): add_rms_norm -> QKV GEMM -> rope_qkv_append (bias, RoPE, K/V into
// the pool) -> attention -> O GEMM (+ bias) -> add_rms_norm (residual add) -> gate_up GEMM ->
// silu_mul -> down GEMM; then the final norm and the LM head (cuda/gemm.h, cuBLAS, fp32 accumulate).
//
// prefill_batch: several sequences, token-packed into chunks (gpu_model_prefill.cpp).
// prefill: one sequence, in chunks of options.prefill_chunk tokens (chunk c attends causally to the
//   cached context, the earlier chunks and itself: cuda_ops::prefill_attention over the key list
//   context_slots ++ slots); the final norm and LM head run on the last row only (every row when
//   all_logits, at most kMaxLogitRows per LM-head call). Logits fp32 are copied to the host.
// decode: one token per request; FastTree attention (cuda/tree_attention.h): the batch's plan (or
//   one planned here when batch.plan is null) is uploaded once per call, then each layer runs the
//   tree kernel on its K/V pool, fp32 out -> bf16 -> O GEMM. DecodeAttention::kReference is not
//   available here (an Error: it runs on the CPU model only). decode() copies logits [B, V] to the
//   host; decode_greedy() reduces on the device (argmax_rows) and copies B int32 only.
// One host synchronization per call (its results); no device allocation once buffers fit.
// Timing: decode_times().total_ms always (host time of decode calls); with set_profiling(true)
// CUDA events split device time into attention / gemm / other / comm (read after each step's sync;
// comm: the tensor-parallel all-reduces, from enqueue to completion on this rank's stream, which
// includes waiting for the slowest peer).
// Tensor parallelism (GpuModelOptions::tp_size > 1, engine/tp_gpu_model.h): one rank's shard; the
// hooks all-reduce the row-parallel outputs and replace blocking waits (see GpuTpHooks).
//
// Numerics vs the fp32 CpuModel: bf16 weights, bf16 GEMM inputs (normed activations, attention
// output, SwiGLU product) and a bf16 KV cache, fp32 accumulation, residual stream and softmax.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "cuda/tree_attention.h"
#include "engine/model.h"
#include "engine/safetensors.h"
#include "engine/weights.h"
#include "plan/planner.h"

struct CUstream_st;

namespace fasttree {

inline constexpr int kDefaultPrefillChunk = 2048;
inline constexpr int kMaxLogitRows = 256;  // rows per LM-head call when prefill returns all logits

// Tensor parallelism hooks (engine/tp_gpu_model.h sets them; a single-GPU model leaves them empty).
struct GpuTpHooks {
  // Sums `count` fp32 at device `data` over the ranks, in place, enqueued on `stream`: called after
  // each row-parallel GEMM (o_proj, with rank 0's bias already added, and down_proj) of every layer.
  std::function<void(float* data, size_t count, CUstream_st* stream)> all_reduce;
  // Waits for `stream` (with a timeout; throws when a peer failed). When set, a call waits through it
  // before any blocking copy and before its final synchronization, so a missing peer never hangs it.
  std::function<void(CUstream_st* stream)> wait;
  // A call failed after enqueueing device work: called before the model synchronizes its stream
  // (the TP model aborts the communicator there, which stops a pending collective).
  std::function<void()> on_error;
  // Called before each all-reduce with its index within the call (tests inject failures; may throw).
  std::function<void(int64_t index)> before_all_reduce;
  // Optional device memory (e.g. an NCCL symmetric window) that holds the row-parallel GEMMs'
  // outputs, and so the all-reduces' data, in every call whose rows fit in it (rows * hidden * 4
  // bytes); larger calls use the model's own buffer. Owned by the caller; outlives the model.
  float* reduce_buffer = nullptr;
  size_t reduce_buffer_bytes = 0;
};

struct GpuModelOptions {
  PlannerConfig planner = engine_planner_config();                // decode planning when the batch brings no plan
  CudaTreeAttentionOptions attention;   // tree-attention kernel knobs
  int prefill_chunk = kDefaultPrefillChunk;  // tokens per prefill chunk (activation rows)
  bool validate_plans = false;          // validate_plan() a plan the batch brings (O(Σ path tokens)
                                        // per step; the kernel's index checks run regardless)
  // Greedy decode steps replay a CUDA graph of the whole step (embedding to argmax) captured on the
  // second consecutive step with the same batch size and buffers (the first one runs plainly, so
  // GEMM tuning happens outside capture); not with profiling. Tensor-parallel ranks capture their
  // NCCL all-reduces too (not when GpuTpHooks::before_all_reduce is set: tests).
  // FT_DECODE_GRAPHS=0 in the environment turns it off.
  bool decode_graphs = true;
  double kv_memory_fraction = 0.9;      // num_slots == 0: largest pool in this fraction of free memory
  int device = -1;                      // >= 0: made current by the constructor (cuda_set_device); every
                                        // later call must come from a thread with this device current
  // Tensor parallelism (engine/tp_shard.h): with tp_size > 1 the model is rank tp_rank's shard of the
  // weights it is given ((a): shard_weights; (b): random_gpu_weights_shard, the same full weights as
  // tp 1; (c): load_gpu_weights_shard, only the rank's blocks read from the checkpoint) and config()
  // is tp_local_config. tp.all_reduce is then required.
  int tp_rank = 0;
  int tp_size = 1;
  GpuTpHooks tp;
};

// Head dim the GPU kernels run a model of head_dim d with: the smallest of 64, 128, 256 that is >= d
// (engine/gpu_weights.h pads the heads); throws above 256.
int gpu_kernel_head_dim(int head_dim);
// Device bytes of one KV slot (K and V of every layer, bf16, kernel head dim).
int64_t gpu_kv_bytes_per_slot(const ModelConfig& config);
// Device bytes of the activation buffers for `rows` token rows (plus the LM head's logits rows).
int64_t gpu_activation_bytes(const ModelConfig& config, int64_t rows);
// Largest KV pool that fits in `fraction` of `free_bytes` after the activations of a prefill chunk
// (0 when none fits), capped at 2^31 - 1 slots.
int32_t gpu_max_kv_slots(const ModelConfig& config, int64_t free_bytes, double fraction = 0.9,
                         int prefill_chunk = kDefaultPrefillChunk);

class GpuModel final : public DecoderModel {
 public:
  // num_slots > 0: a pool of that many slots (an Error naming the bytes needed and free when it does
  // not fit); 0: gpu_max_kv_slots of the free memory once the weights are on the device.
  // (a) fp32 host weights converted to bf16.
  GpuModel(const ModelWeights& weights, int32_t num_slots, GpuModelOptions options = {});
  // (b) seeded random weights (random_gpu_weights: on the device).
  GpuModel(const ModelConfig& config, uint64_t seed, int32_t num_slots, GpuModelOptions options = {});
  // (c) a HF checkpoint (config + safetensors), tensor by tensor to the device (with tp_size > 1 only
  // the rank's blocks of each tensor).
  GpuModel(const SafetensorsFolder& folder, const ModelConfig& config, int32_t num_slots,
           GpuModelOptions options = {});
  ~GpuModel() override;
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  const ModelConfig& config() const override;
  int32_t num_slots() const override;
  int kernel_head_dim() const;
  int64_t weight_bytes() const;
  int64_t kv_pool_bytes() const;
  const Plan& last_plan() const;  // plan of the last decode that planned here

  std::vector<float> prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                             std::span<const int32_t> slots, std::span<const int32_t> context_slots,
                             bool all_logits = false) override;
  // Batched prefill (model.h): token-packed chunks of prefill_chunk rows, varlen attention, one
  // LM-head GEMM per chunk (gpu_model_prefill.cpp). Also rejects a slot written by two sequences and
  // a context slot written by the same or a later sequence of the batch.
  std::vector<float> prefill_batch(std::span<const PrefillSeq> seqs) override;
  std::vector<float> decode(const DecodeBatch& batch, DecodeAttention attention = DecodeAttention::kFastTree) override;
  std::vector<int32_t> decode_greedy(const DecodeBatch& batch,
                                     DecodeAttention attention = DecodeAttention::kFastTree) override;

  void set_profiling(bool on) override;
  DecodeTimes decode_times() const override;
  void reset_times() override;

  // Copies layer `layer`'s K or V pool [num_slots, Hkv, kernel_head_dim] (bf16 bits) to the host (tests).
  std::vector<uint16_t> k_cache(int layer) const;
  std::vector<uint16_t> v_cache(int layer) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fasttree
