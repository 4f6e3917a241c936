// DecoderModel: what the scheduler (engine/scheduler.h) needs from a model backend. CpuModel
// (engine/cpu_model.h, fp32) implements it now; the GPU model implements the same interface.
//
// The model owns a KV pool of num_slots() token slots per layer; the scheduler hands slots out
// (core/slot_pool) and tells the model where each token's K/V goes.
//   prefill: new tokens of ONE sequence (prefill_batch: several, computed together) at `positions`, K/V written to `slots`, attending causally
//            to the cached `context_slots` (already in the pool) followed by the new tokens.
//   decode:  one new token per sequence; `tree` gives each sequence's whole context as a root ->
//            node path ending with its own new slot. When `plan` is set (FastTree attention) it is
//            the planner's plan for exactly this tree and the model executes it as is (the
//            scheduler plans, re-planning only when the batch changes); when null the model plans.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/kv_tree.h"
#include "engine/model_config.h"
#include "plan/plan.h"

namespace fasttree {

enum class DecodeAttention {
  kFastTree,   // Planner + plan executor (CPU: cpu/executor; GPU: the FastTree kernels)
  kReference,  // CPU: reference_attention (cpu/reference, fp64); ignores `plan`
};

// Time a model spent in decode steps since the last reset_times(), by phase (the GPU model measures
// with CUDA events around each phase when profiling is on; the CPU model reports zeros).
struct DecodeTimes {
  int64_t steps = 0;
  double total_ms = 0;      // whole decode steps (host call to results on the host)
  double attention_ms = 0;  // attention kernels (tree attention + merge, or prefill attention)
  double gemm_ms = 0;       // cuBLAS GEMMs (QKV, O, gate/up, down, LM head)
  double other_ms = 0;      // everything else on the device (norms, RoPE/KV append, SwiGLU, argmax, copies)
  double comm_ms = 0;       // tensor-parallel all-reduces (GPU TP model; not part of other_ms)
};

// One sequence of a batched prefill (DecoderModel::prefill_batch): new `tokens` at `positions`, K/V
// written to `slots`, attending causally to `context_slots` followed by its own new tokens. A
// sequence's context may hold slots that an EARLIER sequence of the same batch writes (a prompt
// sharing the prefix another request of the batch computes): sequences are computed in order.
struct PrefillSeq {
  std::span<const int32_t> tokens;
  std::span<const int32_t> positions;
  std::span<const int32_t> slots;
  std::span<const int32_t> context_slots;
};

struct DecodeBatch {
  std::span<const int32_t> tokens;     // [B] input token of each request
  std::span<const int32_t> positions;  // [B] its position (RoPE)
  std::span<const int32_t> slots;      // [B] KV slot its K/V is written to (distinct)
  const KvTree* tree = nullptr;        // B queries; query b's path ends with slots[b]
  const Plan* plan = nullptr;          // FastTree plan of `tree` (nullptr: the model plans)
};

// Checks the batch-level slot rules of prefill_batch, for slots already known to be in [0, num_slots):
// no slot is written by two sequences, and no sequence's context holds a slot that the same or a later
// sequence of the batch writes. Throws a one-line fasttree::Error naming the slot and the sequences.
// `scratch` (the writer of each slot, -1 for none) is sized num_slots on first use and left all -1.
void check_prefill_batch_slots(std::span<const PrefillSeq> seqs, int32_t num_slots, std::vector<int32_t>& scratch);

// The checks both models make on a decode batch's tree, after their own token / position / slot
// checks: a tree is given with one query per request, it is valid with every slot in [0, num_slots),
// each query's path ends with that request's new slot, and no context exceeds the sliding window.
// Returns the batch size. Throws one-line fasttree::Errors ("decode: ...").
int64_t check_decode_tree(const DecodeBatch& batch, const ModelConfig& config, int32_t num_slots);

class DecoderModel {
 public:
  virtual ~DecoderModel() = default;
  virtual const ModelConfig& config() const = 0;
  virtual int32_t num_slots() const = 0;
  // Logits [1, V] of the last new token ([n, V] of every new token when all_logits).
  virtual std::vector<float> prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                                     std::span<const int32_t> slots, std::span<const int32_t> context_slots,
                                     bool all_logits = false) = 0;
  // Logits [S, V]: the last new token's row of each sequence, as if prefill() ran on each in order.
  // Every implementation rejects what check_prefill_batch_slots rejects. Default: one prefill() per
  // sequence; the GPU model computes the whole batch's tokens together (token-packed chunks, one
  // LM-head GEMM per chunk).
  virtual std::vector<float> prefill_batch(std::span<const PrefillSeq> seqs);
  // Logits [B, V].
  virtual std::vector<float> decode(const DecodeBatch& batch,
                                    DecodeAttention attention = DecodeAttention::kFastTree) = 0;
  // Greedy tokens [B] of a decode step (argmax of each row, lowest id on exact ties) without
  // handing the logits back: the GPU model reduces on the device. Default: decode() + greedy_token.
  virtual std::vector<int32_t> decode_greedy(const DecodeBatch& batch,
                                             DecodeAttention attention = DecodeAttention::kFastTree);
  // Per-phase timing of decode steps (DecodeTimes); profiling may add a little time per phase.
  virtual void set_profiling(bool /*on*/) {}
  virtual DecodeTimes decode_times() const { return {}; }
  virtual void reset_times() {}
};

}  // namespace fasttree
