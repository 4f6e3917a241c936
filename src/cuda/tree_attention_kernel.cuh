// FastTree tree-attention kernel (DESIGN.md §4): one persistent launch over all (block, kv head)
// units of a plan (device_plan.h); partial rows are merged by the merge kernel (merge_kernel.cuh).
//
// CTA = 5 warps, warp-specialized:
//   warp 4     producer (tree_attention_producer.cuh): claims units, gathers each 64-token K/V tile
//              (and the unit's Q rows) into a kStages-deep shared-memory ring with TMA / cp.async,
//              resolving KV slots from runs of consecutive slots (no per-token slot loads). The
//              kDeep variant (d = 128, TreeKernelConfig::kQGlobal) stages no Q: its consumers read
//              their Q fragments from global memory and the ring has 3 stages instead of 2.
//   warps 0-3  consumers (tree_attention_consumer.cuh): S = Q K^T and O += P V on tensor cores
//              (full 64-row tiles on wgmma, the rest on mma.sync) with an online softmax, then
//              the unit's normalized rows (+ LSE) to O or to partial rows.
// Stage s of the ring is handed over with mbarriers full[s] (producer -> consumers) and empty[s]
// (consumers -> producer). The producer runs up to kStages tiles ahead, across unit boundaries.
//
// Launch: grid = persistent CTAs (SMs x CTAs per SM), kThreads threads, kSmemBytes dynamic shared
// memory. Before the CTA barrier the producer already gathers its first units' block records, so
// the cold-load chain of the first tile (record -> K/V) overlaps the barrier initialization.
// Measurements: PERF_NOTES.md.
#pragma once
#include <cuda_runtime.h>

#include "cuda/tree_attention_common.cuh"
#include "cuda/tree_attention_consumer.cuh"
#include "cuda/tree_attention_producer.cuh"

namespace fasttree::cuda_detail {

template <class T, int D, bool kDeep>
__global__ void __launch_bounds__(TreeKernelConfig<D, kDeep>::kThreads, TreeKernelConfig<D, kDeep>::kMinBlocks)
    tree_attention_kernel(const __grid_constant__ TreeAttnParams p) {  // grid constant: TMA reads p.tma_k / p.tma_v in place
  using Cfg = TreeKernelConfig<D, kDeep>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // Swizzled tiles must start on 1024-byte boundaries (kSmemBytes has the 1 KB of slack).
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  SmemLayout s;
  s.kv = smem;
  s.q = smem + Cfg::kQOff;
  s.rec = smem + Cfg::kRecOff;
  s.rec_unit = reinterpret_cast<int*>(smem + Cfg::kRecUnitOff);
  s.row_tab = reinterpret_cast<int*>(smem + Cfg::kRowOff);
  s.meta = reinterpret_cast<int4*>(smem + Cfg::kMetaOff);
  s.ml = reinterpret_cast<float2*>(smem + Cfg::kMlOff);
  s.full = reinterpret_cast<uint64_t*>(smem + Cfg::kBarOff);
  s.empty = s.full + Cfg::kStages;
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 32, 0), lane = threadIdx.x % 32;  // warp-uniform role
  // The merge kernel (a programmatic dependent, when so launched) may be placed as CTAs retire; it
  // waits for this whole grid before reading partials.
  griddep_launch_dependents();
  // Barrier 0 (all kThreads threads) is reached from both role branches, once each (non-aligned form).
  if (warp == 4) {
    if (lane == 0) trace_mark(p.trace, kTraceTree, kTrStart);
    if (p.use_tma && lane == 0) {
      tma_prefetch_desc(&p.tma_k);
      tma_prefetch_desc(&p.tma_v);
      tma_prefetch_desc(&p.tma_k16);
      tma_prefetch_desc(&p.tma_v16);
      tma_prefetch_desc(&p.tma_k8);
      tma_prefetch_desc(&p.tma_v8);
    }
    Producer<T, D, kDeep> prod(p, s, lane);
    prod.prologue();
    named_barrier_split(0, Cfg::kThreads);
    prod.run();
  } else {
    if (threadIdx.x == 0) {
      for (int i = 0; i < Cfg::kStages; ++i) {
        mbar_init(&s.full[i], 64);                      // producer lanes: cp.async + plain arrival each
        mbar_init(&s.empty[i], Cfg::kConsumerThreads);  // every consumer thread
      }
      fence_mbarrier_init();  // the initialized barriers, before TMA (async proxy) completes on them
    }
    named_barrier_split(0, Cfg::kThreads);
    Consumer<T, D, kDeep> cons(p, s, warp, lane);
    cons.run();
  }
}

}  // namespace fasttree::cuda_detail
