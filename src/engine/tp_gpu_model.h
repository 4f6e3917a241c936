// TpGpuModel: tensor-parallel GPU model (issue 5): tp ranks on tp GPUs of one host, one persistent
// thread per rank (its device made current once, every CUDA/NCCL call of the rank on that thread),
// each a GpuModel (engine/gpu_model.h) over its weight shard (engine/tp_shard.h) and its own KV
// pool shard [num_slots, Hkv_local, dk] per layer. Column-parallel QKV and gate/up, row-parallel
// o_proj and down_proj whose fp32 outputs [m, h] are summed over the ranks by an NCCL all-reduce
// (cuda/nccl_comm.h) on the rank's compute stream before each residual add; o_proj's bias lives on
// rank 0 (zeros elsewhere) and is added before the sum, so it counts once. Embedding, norms and
// lm_head are replicated: every rank computes the same logits and rank 0's are returned.
// It is the GPU counterpart of TpCpuModel (engine/tp_cpu_model.h), with the same plan sharing:
//
//   The scheduler, radix cache and planner run once, outside the ranks: config() is the whole
//   model's, slots are shared (every rank writes token t's K/V for its heads to the same slot), and
//   a FastTree decode plans once per call (or takes the batch's plan, built for the whole shape or
//   the rank-local one) and every rank executes a copy with the rank-local head counts patched in.
//   Planning cost does not grow with tp.
//
// NCCL: one communicator group created once at construction (NcclComm::create_group, with
// NCCL_NVLS_ENABLE=0 set first), before the ranks allocate their KV pools. Weights: a preset's
// random weights are generated whole per tensor on every rank and sliced (random_gpu_weights_shard),
// so tp N runs exactly the weights of tp 1; host ModelWeights (e.g. a checkpoint loaded in fp32 on
// the host) are sharded with shard_weights.
//
// Failures: a missing GPU (fewer than tp visible), heads or intermediate size that do not split, or
// a backend without NCCL are an Error at construction. During a call, a rank whose device work fails
// aborts its communicator and asks every peer to abort (NcclComm::request_abort): they leave their
// collectives / waits at once; a peer that never arrives makes the others fail after
// options.timeout (waits poll with a timeout: never a hang). The call then throws one Error naming
// the first failing rank; last_rank_errors() holds every rank's message. After a failure in device
// work the communicators are aborted and every later call throws (the model must be rebuilt). A call
// whose ranks all reject their input before any device work (the same checks as GpuModel) leaves
// the model usable.
//
// Timing: decode_times() is rank 0's device split (attention / gemm / other, and comm_ms: its
// all-reduces, which include waiting for the slowest peer), with steps and total_ms measured here
// around whole calls (dispatch, planning and the slowest rank included).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/gpu_model.h"
#include "engine/model.h"
#include "engine/weights.h"
#include "plan/plan.h"

namespace fasttree {

inline constexpr std::chrono::milliseconds kTpGpuDefaultTimeout{120000};

struct TpGpuModelOptions {
  int tp = 2;                  // ranks = GPUs
  std::vector<int> devices;    // rank r's device; empty = 0, 1, ..., tp - 1
  GpuModelOptions model;       // per-rank options (planner, attention, prefill_chunk, kv_memory_fraction);
                               // device, tp_rank, tp_size and the hooks are set per rank
  // Communicator initialisation and every wait for a rank's stream (a step, a prefill) at most this.
  std::chrono::milliseconds timeout = kTpGpuDefaultTimeout;
  // Called on rank `rank`'s thread before each of its all-reduces with the index of that all-reduce
  // within the call (0, 1, ...: 2 per layer); may throw or stall: tests inject failures through it.
  std::function<void(int rank, int64_t index)> before_all_reduce;
  // All-reduce on NCCL symmetric windows (cuda/nccl_comm.h): each rank's row-parallel GEMM output
  // lives in a registered window of max(prefill_chunk, kTpWindowMinRows) rows, so NCCL can run its
  // low-latency symmetric kernels. Falls back to plain buffers (all_reduce_path() says why) when the
  // host cannot make the windows. FT_NCCL_SYMMETRIC=0 in the environment turns it off (A/B runs).
  bool symmetric_windows = true;
  // A one-shot all-reduce over peer access (cuda/p2p_all_reduce.h) for every all-reduce of at most
  // kTpP2pMaxBytes (decode steps): the rank's buffer takes the place of the symmetric window, and
  // larger all-reduces (prefill) go to NCCL. Needs peer access between every pair of devices (else
  // NCCL as above; all_reduce_path() says which). FT_TP_P2P=1 / 0 in the environment overrides this
  // flag. Measured on the H200 pair: ~22 us per 2 MiB all-reduce inside llama2-7b decode steps, vs
  // 30 us for NCCL on symmetric windows and 47 us on plain buffers.
  bool p2p_all_reduce = true;
};

inline constexpr size_t kTpP2pMaxBytes = size_t{8} << 20;

inline constexpr int kTpWindowMinRows = 1024;

class TpGpuModel final : public DecoderModel {
 public:
  // num_slots > 0: that many slots on every rank; 0: the largest pool every rank can hold
  // (gpu_max_kv_slots of each device's free memory after its shard; the minimum over the ranks).
  // Host weights of the whole model, sharded (shard_weights).
  TpGpuModel(const ModelWeights& weights, int32_t num_slots, TpGpuModelOptions options = {});
  // A HF checkpoint: every rank reads only its blocks of each tensor from the mmap'd safetensors
  // (load_gpu_weights_shard), so the host never holds the whole model (a 70B checkpoint's fp32 host
  // copy would be ~280 GB).
  TpGpuModel(const SafetensorsFolder& folder, const ModelConfig& config, int32_t num_slots, TpGpuModelOptions options = {});
  // A preset's seeded random weights: the same full weights as GpuModel(config, seed, ...).
  TpGpuModel(const ModelConfig& config, uint64_t seed, int32_t num_slots, TpGpuModelOptions options = {});
  ~TpGpuModel() override;
  TpGpuModel(const TpGpuModel&) = delete;
  TpGpuModel& operator=(const TpGpuModel&) = delete;

  const ModelConfig& config() const override;  // the whole model's
  int32_t num_slots() const override;
  int tp() const;
  const ModelConfig& local_config() const;  // a rank's (tp_local_config)
  const Plan& last_plan() const;             // rank-local plan of the last FastTree decode

  std::vector<float> prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                             std::span<const int32_t> slots, std::span<const int32_t> context_slots,
                             bool all_logits = false) override;
  std::vector<float> prefill_batch(std::span<const PrefillSeq> seqs) override;  // every rank's prefill_batch
  // batch.plan, when set, must have been built for config().attn_shape() or the rank-local shape.
  std::vector<float> decode(const DecodeBatch& batch, DecodeAttention attention = DecodeAttention::kFastTree) override;
  std::vector<int32_t> decode_greedy(const DecodeBatch& batch,
                                     DecodeAttention attention = DecodeAttention::kFastTree) override;

  void set_profiling(bool on) override;
  DecodeTimes decode_times() const override;
  void reset_times() override;

  // How the all-reduces run: "p2p one-shot up to N MiB, nccl above", "nccl symmetric windows (N MiB
  // per rank)" or "nccl (...: why not)".
  const std::string& all_reduce_path() const;
  // Every rank's error message of the last failed call ("" for a rank that finished).
  const std::vector<std::string>& last_rank_errors() const;
  // Decode steps whose greedy tokens differed between rank 0 and another rank (replicated LM head:
  // expected 0; counted, not thrown).
  int64_t replica_mismatches() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fasttree
