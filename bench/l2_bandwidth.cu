// Microbenchmark: how many bytes per second the SMs can pull from L2 (or DRAM) into shared
// memory, the way the tree kernel's producer does (bulk async copies into an mbarrier ring) and
// with plain 16-byte vector loads, so that a kernel's plan bytes per second can be read against
// the machine's ceiling (PERF_NOTES.md, session 12).
//
// A third mode issues each 32 KB stage as the tree kernel's full K/V tile: four TMA tile loads of
// 64 x 64 fp16 boxes (128-byte swizzle) from a [rows][128] tensor, optionally with a consumer that
// holds each stage for a fixed time (the tree kernel's consumer takes ~1 us per 64 x 64 tile), and
// reports the producer's cycles per stage spent in the issue alone (expect_tx + copies, empty waits
// excluded): whether the copy instructions themselves stall under load.
//
// Built by CMake with the benchmarks (FASTTREE_BENCH, CUDA): build-gpu/l2_bandwidth.
// Usage: l2_bandwidth [tma]   (prints one line per configuration: mode, buffer, CTAs/SM, stages,
// chunk, TB/s; with "tma" only the tile-load modes (TMA, bulk, cp.async), with their issue cycles
// per stage)
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_check_exit.h"

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);


__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void bar_init(uint64_t* b, uint32_t n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(saddr(b)) : "memory");
}
__device__ __forceinline__ void bar_arrive_tx(uint64_t* b, uint32_t tx) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(saddr(b)), "r"(tx) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* b, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(saddr(b)), "r"(parity)
                 : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(saddr(b))
               : "memory");
}

// Thread 0 initializes the ring's full / empty mbarriers (full_arrivals / one arrival); then a CTA
// barrier.
__device__ void ring_init(uint64_t* full, uint64_t* empty, int stages, int full_arrivals = 1) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      bar_init(&full[s], full_arrivals);
      bar_init(&empty[s], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// The consumer warp: waits for each of `iters` stages of `stage_bytes`, touches it, holds it hold_ns
// (globaltimer spin; 0: none) and frees it.
__device__ void consume(uint64_t* full, uint64_t* empty, const unsigned char* ring, int stage_bytes, int stages,
                        int iters, int hold_ns, int* sink) {
  int acc = 0;
  for (int i = 0; i < iters; ++i) {
    const int s = i % stages;
    bar_wait(&full[s], (i / stages) & 1);
    acc += ring[static_cast<size_t>(s) * stage_bytes + threadIdx.x * 4];
    if (hold_ns > 0) {
      unsigned long long t0, t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
      do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      } while (t - t0 < static_cast<unsigned long long>(hold_ns));
    }
    __syncwarp();
    if (threadIdx.x == 0) bar_arrive(&empty[s]);
  }
  if (acc == 0x7fffffff) *sink = acc;
}

// One producer thread streams `iters` chunks of `chunk` bytes per CTA into a `stages`-deep ring
// (pieces of at most 16 KB per bulk copy); one consumer warp waits for each and frees it.
__global__ void bulk_kernel(const char* buf, size_t buf_bytes, int chunk, int stages, int iters, int* sink) {
  extern __shared__ __align__(128) unsigned char sm[];
  uint64_t* full = reinterpret_cast<uint64_t*>(sm);
  uint64_t* empty = full + 8;
  unsigned char* ring = sm + 128;
  ring_init(full, empty, stages);
  const size_t nchunks = buf_bytes / chunk;
  if (threadIdx.x == 32) {  // producer
    for (int i = 0; i < iters; ++i) {
      const int s = i % stages;
      if (i >= stages) bar_wait(&empty[s], ((i / stages) - 1) & 1);
      const size_t c = (static_cast<size_t>(blockIdx.x) * 7919 + static_cast<size_t>(i) * gridDim.x) & (nchunks - 1);  // a power of two
      const char* src = buf + c * chunk;
      bar_arrive_tx(&full[s], chunk);
      for (int off = 0; off < chunk; off += 16384) {
        const int n = chunk - off < 16384 ? chunk - off : 16384;
        bulk_copy(saddr(ring + static_cast<size_t>(s) * chunk + off), src + off, n, &full[s]);
      }
    }
  } else if (threadIdx.x < 32) {
    consume(full, empty, ring, chunk, stages, iters, 0, sink);
  }
}

// Each stage is one 64-row K/V tile of a [rows][128] fp16 tensor: K = rows [r, r + 64), V = rows
// [r + rows / 2, +64), each as two 64-column boxes (tensor = 1), as two 8 KB bulk copies of the
// same bytes, unswizzled (tensor = 0), or by the whole producer warp as 16-byte cp.async, 64 per
// lane, the tree kernel's path for tiles that TMA cannot load (tensor = 2; each lane then arrives
// once on the full barrier when its copies land). The consumer warp holds each stage hold_ns before
// releasing it. issue[blockIdx.x] = the producer's (lane 0's) clock64 cycles in expect_tx + copies,
// summed over stages.
__global__ void tile_kernel(const __grid_constant__ CUtensorMap map, const char* buf, int rows, int tensor, int stages,
                            int iters, int hold_ns, unsigned long long* issue, int* sink) {
  extern __shared__ __align__(1024) unsigned char sm[];
  uint64_t* full = reinterpret_cast<uint64_t*>(sm);
  uint64_t* empty = full + 8;
  unsigned char* ring = sm + 1024;
  constexpr int kStage = 32768;
  ring_init(full, empty, stages, tensor == 2 ? 32 : 1);
  const int tiles = rows / 2 / 64;  // a power of two
  const bool warp_copies = tensor == 2;  // the whole producer warp copies; else thread 32 alone
  if (threadIdx.x == 32 || (warp_copies && threadIdx.x > 32)) {  // producer
    const int lane = threadIdx.x - 32;
    unsigned long long cyc = 0;
    for (int i = 0; i < iters; ++i) {
      const int s = i % stages;
      if (i >= stages) bar_wait(&empty[s], ((i / stages) - 1) & 1);
      const int r = ((blockIdx.x * 7919 + i * gridDim.x) & (tiles - 1)) * 64;
      const uint32_t dst = saddr(ring + static_cast<size_t>(s) * kStage);
      const unsigned long long t0 = clock64();
      if (warp_copies) {
        for (int h = 0; h < 2; ++h) {
          const char* src = buf + static_cast<size_t>(r + h * (rows / 2)) * 256 + lane * 16;
#pragma unroll 8
          for (int j = 0; j < 32; ++j)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + h * 16384 + j * 512 + lane * 16),
                         "l"(src + j * 512)
                         : "memory");
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(saddr(&full[s])) : "memory");
      } else {
        bar_arrive_tx(&full[s], kStage);
        for (int h = 0; h < 2; ++h) {
          const int row = r + h * (rows / 2);
          for (int cb = 0; cb < 2; ++cb) {
            const uint32_t d = dst + h * 16384 + cb * 8192;
            if (tensor) {
              asm volatile(
                  "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(d),
                  "l"(&map), "r"(cb * 64), "r"(row), "r"(saddr(&full[s]))
                  : "memory");
            } else {
              bulk_copy(d, buf + static_cast<size_t>(row) * 256 + cb * 8192, 8192, &full[s]);
            }
          }
        }
      }
      cyc += clock64() - t0;
    }
    if (warp_copies) asm volatile("cp.async.wait_all;" ::: "memory");
    if (lane == 0) issue[blockIdx.x] = cyc;
  } else if (threadIdx.x < 32) {
    consume(full, empty, ring, kStage, stages, iters, hold_ns, sink);
  }
}

// Every thread loads 16-byte vectors, `unroll` in flight, grid-strided over chunks.
template <int kUnroll>
__global__ void ldg_kernel(const int4* buf, size_t n16, int iters, int* sink) {
  int acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) & (n16 - 1);  // n16: a power of two
  for (int it = 0; it < iters; ++it) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcg(buf + ((i + u * stride) & (n16 - 1)));
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].w;
    i = (i + kUnroll * stride) & (n16 - 1);
  }
  if (acc == 0x7fffffff) *sink = acc;
}

int main(int argc, char** argv) {
  const bool tma_only = argc > 1 && std::strcmp(argv[1], "tma") == 0;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t big = size_t(1) << 30;
  char* buf = nullptr;
  int* sink = nullptr;
  CK(cudaMalloc(&buf, big));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(buf, 1, big));
  CK(cudaFuncSetAttribute(bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time_it = [&](auto launch) {
    launch();
    CK(cudaDeviceSynchronize());
    std::vector<float> ts;
    for (int r = 0; r < 7; ++r) {
      CK(cudaEventRecord(e0));
      launch();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };
  std::printf("mode,buffer_mb,ctas_per_sm,stages,chunk_kb,threads,us,tb_per_s\n");
  // Tile modes: TMA tile loads vs bulk copies of the same 32 KB per stage; hold = consumer ns per stage.
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult qr{};
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &qr));
  if (fn == nullptr) {
    std::fprintf(stderr, "no cuTensorMapEncodeTiled\n");
    return 1;
  }
  CK(cudaFuncSetAttribute(tile_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 * 1024));
  unsigned long long* issue = nullptr;
  CK(cudaMalloc(&issue, sizeof(unsigned long long) * sms * 4));
  std::printf("tile_mode,buffer_mb,ctas_per_sm,stages,hold_ns,us,tb_per_s,issue_cycles_per_stage_median\n");
  for (size_t buf_mb : {16, 1024}) {
    const int rows = static_cast<int>((buf_mb << 20) / 256);
    CUtensorMap map;
    const cuuint64_t dims[2] = {128, static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {256};
    const cuuint32_t box[2] = {64, 64};
    const cuuint32_t es[2] = {1, 1};
    if (reinterpret_cast<EncodeTiled>(fn)(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, buf, dims, strides, box, es,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      std::fprintf(stderr, "cuTensorMapEncodeTiled failed\n");
      return 1;
    }
    for (int tensor : {1, 0, 2}) {
      for (int cps : {1, 2}) {
        for (int stages : {2, 3, 4}) {
          for (int hold : {0, 500, 1000}) {
            const int smem = 1024 + stages * 32768;
            if (smem * cps > 227 * 1024) continue;
            const int grid = sms * cps, iters = hold > 0 ? 100 : 400;
            const float ms = time_it([&] { tile_kernel<<<grid, 64, smem>>>(map, buf, rows, tensor, stages, iters, hold, issue, sink); });
            CK(cudaGetLastError());
            std::vector<unsigned long long> cyc(grid);
            CK(cudaMemcpy(cyc.data(), issue, sizeof(unsigned long long) * grid, cudaMemcpyDeviceToHost));
            std::sort(cyc.begin(), cyc.end());
            const double tot = double(grid) * iters * 32768;
            std::printf("%s,%zu,%d,%d,%d,%.1f,%.2f,%.0f\n", tensor == 2 ? "cp.async" : tensor ? "tma" : "bulk8k", buf_mb, cps, stages, hold, ms * 1e3,
                        tot / (ms * 1e-3) / 1e12, double(cyc[grid / 2]) / iters);
          }
        }
      }
    }
  }
  if (tma_only) return 0;
  for (size_t buf_mb : {8, 16, 1024}) {
    const size_t bytes = buf_mb << 20;
    for (int cps : {1, 2, 3}) {
      for (int stages : {2, 3, 4, 6}) {
        for (int chunk : {16384, 32768}) {
          const int smem = 128 + stages * chunk;
          if (smem * cps > 227 * 1024) continue;
          const int grid = sms * cps, iters = 400;
          const float ms = time_it([&] { bulk_kernel<<<grid, 64, smem>>>(buf, bytes, chunk, stages, iters, sink); });
          CK(cudaGetLastError());
          const double tot = double(grid) * iters * chunk;
          std::printf("bulk,%zu,%d,%d,%d,64,%.1f,%.2f\n", buf_mb, cps, stages, chunk / 1024, ms * 1e3, tot / (ms * 1e-3) / 1e12);
        }
      }
    }
    for (int threads : {256, 512, 1024}) {
      const int grid = sms * (2048 / threads), iters = 200;
      const size_t n16 = bytes / 16;
      const float ms = time_it([&] { ldg_kernel<4><<<grid, threads>>>(reinterpret_cast<const int4*>(buf), n16, iters, sink); });
      CK(cudaGetLastError());
      const double tot = double(grid) * threads * iters * 4 * 16;
      std::printf("ldg4,%zu,%d,0,0,%d,%.1f,%.2f\n", buf_mb, 2048 / threads, threads, ms * 1e3, tot / (ms * 1e-3) / 1e12);
    }
  }
  return 0;
}
