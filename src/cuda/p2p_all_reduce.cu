// One-shot all-reduce over peer access (cuda/p2p_all_reduce.h): kernel and launcher.
#include <cuda_runtime.h>

#include "cuda/p2p_all_reduce_kernel.cuh"

namespace fasttree {
namespace {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// A peer's data: never from a cache that could hold an older call's values.
__device__ __forceinline__ float4 ld_volatile_f4(const float4* p) {
  float4 v;
  asm volatile("ld.volatile.global.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p));
  return v;
}

// flags layout: [phase 2][block kP2pMaxBlocks][source rank kP2pMaxRanks]
__device__ __forceinline__ size_t flag_index(int phase, int block, int src) {
  return (static_cast<size_t>(phase) * kP2pMaxBlocks + block) * kP2pMaxRanks + src;
}

// Block-level barrier with the same block of every peer: thread q (< nranks, != rank) tells rank q
// that this block reached `phase` of call `e`, then waits until rank q says the same. False (in
// every thread) when a wait gave up: the group was aborted or the timeout passed.
__device__ bool peer_barrier(const P2pAllReduceParams& p, int phase, uint32_t e) {
  bool ok = true;
  const int q = threadIdx.x;
  if (q < p.nranks && q != p.rank) {
    __threadfence_system();  // this block's earlier loads / stores come before the signal
    st_release_sys(p.flags[q] + flag_index(phase, blockIdx.x, p.rank), e);
    const uint32_t* mine = p.flags[p.rank] + flag_index(phase, blockIdx.x, q);
    const uint64_t t0 = global_timer_ns();
    for (uint32_t i = 0; static_cast<int32_t>(ld_acquire_sys(mine) - e) < 0; ++i) {
      if ((i & 127u) != 127u) continue;
      // The abort flag lives in host memory: reading it over PCIe while a peer is merely a little
      // late made every all-reduce ~100 us slower (measured inside decode steps), so it is read only
      // once a wait has lasted kP2pHostPollAfterNs, which only a failing group reaches.
      const uint64_t waited = global_timer_ns() - t0;
      if (waited > p.timeout_ns || (waited > kP2pHostPollAfterNs && *p.abort_flag != 0)) {
        ok = false;
        break;
      }
    }
  }
  return __syncthreads_and(ok) != 0;
}

__global__ void __launch_bounds__(kP2pThreads) p2p_all_reduce_kernel(const __grid_constant__ P2pAllReduceParams p) {
  __shared__ uint32_t epoch_sh;
  if (threadIdx.x == 0) epoch_sh = p.epoch[blockIdx.x] + 1;
  __syncthreads();
  const uint32_t e = epoch_sh;
  if (!peer_barrier(p, 0, e)) {  // every rank's data is in its buffer
    if (threadIdx.x == 0) *p.error_flag = 1;
    return;
  }
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kP2pThreads * p.vec_per_thread + threadIdx.x;
  float4 acc[kP2pMaxVecPerThread];
#pragma unroll
  for (int v = 0; v < kP2pMaxVecPerThread; ++v) {
    const int64_t i = base + static_cast<int64_t>(v) * kP2pThreads;
    if (v >= p.vec_per_thread || i >= p.count4) break;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < kP2pMaxRanks; ++r) {  // rank order: every rank computes the same sums
      if (r >= p.nranks) break;
      const float4* src = reinterpret_cast<const float4*>(p.bufs[r]) + i;
      const float4 x = r == p.rank ? *src : ld_volatile_f4(src);
      if (r == 0) {
        s = x;
      } else {
        s.x += x.x, s.y += x.y, s.z += x.z, s.w += x.w;
      }
    }
    acc[v] = s;
  }
  // This thread's loads of the peers' buffers are complete before the block says "done reading"
  // (a barrier alone does not wait for loads in flight; measured: without it a fast peer could
  // overwrite its buffer while this rank still read it).
  __threadfence_system();
  if (!peer_barrier(p, 1, e)) {  // every peer has read this block's range of this rank's buffer
    if (threadIdx.x == 0) *p.error_flag = 1;
    return;
  }
#pragma unroll
  for (int v = 0; v < kP2pMaxVecPerThread; ++v) {
    const int64_t i = base + static_cast<int64_t>(v) * kP2pThreads;
    if (v >= p.vec_per_thread || i >= p.count4) break;
    reinterpret_cast<float4*>(p.data)[i] = acc[v];
  }
  if (threadIdx.x == 0) p.epoch[blockIdx.x] = e;
}

}  // namespace

void launch_p2p_all_reduce(const P2pAllReduceParams& p, int blocks, CUstream_st* stream) {
  p2p_all_reduce_kernel<<<blocks, kP2pThreads, 0, stream>>>(p);
}

}  // namespace fasttree
