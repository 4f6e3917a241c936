// Per-request baseline (what serving engines run today, FlashDecoding-style split-KV): every query
// reads its whole root->node path on its own, with no K/V sharing between queries; the g qo heads
// of one KV head are the rows of one tile (grouped GQA, like FlashInfer's decode kernel). Long paths
// are split into chunks so that all SMs get work, and the chunks are merged by LSE.
//
// It is expressed as a Plan (one vnode per query over its path's segments, chunked like the
// planner's context splitting) and executed by the same CUDA kernels, so timings against the
// FastTree plan isolate the effect of sharing. Plain C++: also runs on the CPU executor.
#pragma once
#include <cstdint>

#include "core/attention_shape.h"
#include "core/kv_tree.h"
#include "plan/plan.h"

namespace fasttree {

struct PerRequestConfig {
  int num_sms = 132;          // chunks target num_sms * waves items of equal length
  double waves = 1.0;
  int64_t min_chunk = 256;    // never split a path into chunks shorter than this
  int kv_tile = 64;           // chunk lengths are multiples of this
};

// Builds the per-request plan of `tree` into `plan` (buffers reused). A query with an empty path
// gets no item: it is non-direct with no merge rows (O = 0, LSE = -inf).
void build_per_request_plan(const KvTree& tree, const AttnShape& shape, const PerRequestConfig& config, Plan& plan);

}  // namespace fasttree
