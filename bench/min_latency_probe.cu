// Microbenchmark: the least time one decode-attention launch takes on this machine when its inputs
// are cold, for the smallest cells of the paper suite (one query of GQA 16 at d = 128 over 16 or
// 64 tokens, one KV head). The tree kernel's `fasttree bench --diag` measures such a cell at
// 8.1-8.2 us (16 tokens) against 2.6-2.8 us for an empty kernel (PERF_NOTES.md, session 28); this
// probe says how much of that difference the memory system charges any kernel: a dependent read of
// the slot table, then the K/V rows it names, Q beside them, and the stores.
//
// Kernels (one CTA of 128 threads; the memory side only: the attention arithmetic of one 16 x 64
// tile is a few hundred cycles on tensor cores):
//   empty       nothing.
//   table       slots read from a table in global memory (two dependent round trips: table, K/V),
//               Q read beside them, 8 KB of fp32 output written.
//   params      the same with the slots in the kernel parameters (one round trip).
// Inputs are cold like the tree kernel's rotated inputs: every timed run reads its own Q copy, its
// own slot table and K/V rows at slots drawn at random from 2 x 256 MB pools, all untouched since a
// 512 MB read flush; the code is warm (every kernel ran before). Each run is one graph replay, queued
// behind a sleeping kernel so that no run waits for the host; medians of CUDA-event timings. The
// output of one run per kernel is checked bit for bit against the host's fold of the same inputs.
//
// Built by CMake with the benchmarks (FASTTREE_BENCH, CUDA): build-gpu/min_latency_probe.
// Usage: min_latency_probe [tokens]   (default: 16 and 64)
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda_check_exit.h"

namespace {

constexpr int kD = 128;         // head dim
constexpr int kRows = 16;       // query rows (one query x 16 heads of one KV head)
constexpr int kMaxTokens = 64;  // tokens per run
constexpr int kThreads = 128;
constexpr int kRuns = 200;                        // timed runs (each on its own inputs)
constexpr int kWarm = 10;                         // untimed runs first (code and launch path warm)
constexpr int64_t kSlots = 1 << 20;               // slots per pool: 1 Mi x 256 bytes = 256 MB
constexpr size_t kFlushBytes = size_t(512) << 20;  // read before the timed runs

struct Slots {
  int s[kMaxTokens];
};

// The memory side of one launch, with none of the arithmetic: every thread reads its share of Q
// (2 uint4) and of the n K / V rows (through the slot table or the parameters), folds them into
// one word and writes 16 floats of the [16][128] fp32 output derived from it, so that no load can
// be dropped. The attention arithmetic of a 16 x 64 tile takes a few hundred cycles on tensor
// cores; what this kernel leaves out is that, not the round trips.
template <bool kFromTable>
__global__ void __launch_bounds__(kThreads) touch_kernel(const int* __restrict__ table, Slots slots,
                                                          const __half* __restrict__ q,
                                                          const __half* __restrict__ kpool,
                                                          const __half* __restrict__ vpool, float* __restrict__ out,
                                                          int n) {
  const int t = threadIdx.x;
  uint32_t x = 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint4 v = reinterpret_cast<const uint4*>(q)[t + i * kThreads];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  constexpr int kPer = kMaxTokens * 16 / kThreads;  // (token, 16-byte chunk) pairs per thread
  uint4 kv[kPer], vv[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = t + i * kThreads, tok = idx >> 4, c = idx & 15;
    kv[i] = vv[i] = make_uint4(0, 0, 0, 0);
    if (tok < n) {
      const int slot = kFromTable ? __ldg(table + tok) : slots.s[tok];
      kv[i] = reinterpret_cast<const uint4*>(kpool + static_cast<int64_t>(slot) * kD)[c];
      vv[i] = reinterpret_cast<const uint4*>(vpool + static_cast<int64_t>(slot) * kD)[c];
    }
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) x ^= kv[i].x ^ kv[i].y ^ kv[i].z ^ kv[i].w ^ vv[i].x ^ vv[i].y ^ vv[i].z ^ vv[i].w;
  const float f = __uint_as_float((x & 0x007fffffu) | 0x3f800000u);
#pragma unroll
  for (int k = 0; k < 16; k += 4) *reinterpret_cast<float4*>(out + t * 16 + k) = make_float4(f, f + 1, f + 2, f + 3);
}

__global__ void empty_kernel() {}

// Spins ~ns nanoseconds so that the runs queued behind it start back to back.
__global__ void delay_kernel(uint64_t ns) {
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    uint64_t t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (t1 - t0 >= ns) break;
  }
}

__global__ void read_flush(const uint4* p, size_t n, unsigned* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) x ^= p[i].x;
  if (x == 0x9e3779b9u) atomicAdd(sink, 1u);
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Bufs {
  __half* kpool;
  __half* vpool;
  __half* q;       // [kRuns + kWarm][16][128]
  int* table;      // [kRuns + kWarm][kMaxTokens]
  float* out;      // [kRuns + kWarm][16][128]
  uint4* flush;
  unsigned* sink;
  std::vector<int> slots;  // host copy of the tables
};

// kind 0 empty, 1 table, 2 params; each run is one CUDA graph replay of one launch (as in the tree
// kernel's harness). Returns the median us of kRuns cold runs.
float time_kind(const Bufs& b, int kind, int n, cudaStream_t st) {
  const int total = kRuns + kWarm;
  std::vector<cudaGraphExec_t> exec(total);
  for (int i = 0; i < total; ++i) {
    Slots s{};
    for (int j = 0; j < n; ++j) s.s[j] = b.slots[i * kMaxTokens + j];
    const int* tab = b.table + i * kMaxTokens;
    const __half* q = b.q + static_cast<size_t>(i) * kRows * kD;
    float* o = b.out + static_cast<size_t>(i) * kRows * kD;
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    if (kind == 0) empty_kernel<<<1, kThreads, 0, st>>>();
    if (kind == 1) touch_kernel<true><<<1, kThreads, 0, st>>>(tab, s, q, b.kpool, b.vpool, o, n);
    if (kind == 2) touch_kernel<false><<<1, kThreads, 0, st>>>(tab, s, q, b.kpool, b.vpool, o, n);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&exec[i], g, 0));
    CK(cudaGraphDestroy(g));
  }
  for (int i = kRuns; i < total; ++i) CK(cudaGraphLaunch(exec[i], st));  // warm-up on inputs the timed runs do not use
  for (int i = 0; i < kRuns; ++i) CK(cudaGraphUpload(exec[i], st));
  read_flush<<<1056, 256, 0, st>>>(b.flush, kFlushBytes / sizeof(uint4), b.sink);
  CK(cudaGetLastError());
  std::vector<cudaEvent_t> ev(2 * kRuns);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  delay_kernel<<<1, 1, 0, st>>>(2'000'000 + 20'000ull * kRuns);
  for (int i = 0; i < kRuns; ++i) {
    CK(cudaEventRecord(ev[2 * i], st));
    CK(cudaGraphLaunch(exec[i], st));
    CK(cudaEventRecord(ev[2 * i + 1], st));
  }
  CK(cudaStreamSynchronize(st));
  std::vector<float> us(kRuns);
  for (int i = 0; i < kRuns; ++i) {
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    us[i] = ms * 1000.0f;
  }
  for (auto& e : ev) CK(cudaEventDestroy(e));
  for (auto& e : exec) CK(cudaGraphExecDestroy(e));
  return median(us);
}

// Whether run i's output is what touch_kernel must write for the host copies of its inputs.
bool check_run(const Bufs& b, const std::vector<uint32_t>& hq, const std::vector<uint32_t>& hk,
               const std::vector<uint32_t>& hv, int i, int n) {
  std::vector<float> o(kRows * kD);
  CK(cudaMemcpy(o.data(), b.out + static_cast<size_t>(i) * kRows * kD, o.size() * 4, cudaMemcpyDeviceToHost));
  for (int t = 0; t < kThreads; ++t) {
    uint32_t x = 0;
    for (int k = 0; k < 2; ++k)
      for (int w = 0; w < 4; ++w) x ^= hq[(static_cast<size_t>(i) * kRows * kD / 2) + (t + k * kThreads) * 4 + w];
    for (int idx = t; idx < kMaxTokens * 16; idx += kThreads) {
      const int tok = idx >> 4, c = idx & 15;
      if (tok >= n) continue;
      const int64_t slot = b.slots[i * kMaxTokens + tok];
      for (int w = 0; w < 4; ++w) x ^= hk[slot * kD / 2 + c * 4 + w] ^ hv[slot * kD / 2 + c * 4 + w];
    }
    uint32_t bits = (x & 0x007fffffu) | 0x3f800000u;
    float f;
    std::memcpy(&f, &bits, 4);
    for (int k = 0; k < 16; ++k)
      if (o[t * 16 + k] != f + static_cast<float>(k % 4)) return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> token_counts = {16, 64};
  if (argc > 1) token_counts = {std::atoi(argv[1])};
  for (int n : token_counts)
    if (n < 1 || n > kMaxTokens) {
      std::fprintf(stderr, "tokens must be in [1, %d]\n", kMaxTokens);
      return 1;
    }
  const int total = kRuns + kWarm;
  std::mt19937 rng(7);
  // Random 32-bit words (two fp16 values each; the probe never interprets them).
  std::vector<uint32_t> hk(kSlots * kD / 2), hv(kSlots * kD / 2), hq(static_cast<size_t>(total) * kRows * kD / 2);
  for (auto& x : hk) x = rng();
  for (auto& x : hv) x = rng();
  for (auto& x : hq) x = rng();
  std::uniform_int_distribution<int> pick(0, static_cast<int>(kSlots) - 1);
  Bufs b{};
  b.slots.resize(static_cast<size_t>(total) * kMaxTokens);
  for (auto& s : b.slots) s = pick(rng);
  CK(cudaMalloc(&b.kpool, hk.size() * 4));
  CK(cudaMalloc(&b.vpool, hv.size() * 4));
  CK(cudaMalloc(&b.q, hq.size() * 4));
  CK(cudaMalloc(&b.table, b.slots.size() * 4));
  CK(cudaMalloc(&b.out, static_cast<size_t>(total) * kRows * kD * 4));
  CK(cudaMalloc(&b.flush, kFlushBytes));
  CK(cudaMalloc(&b.sink, 4));
  CK(cudaMemcpy(b.kpool, hk.data(), hk.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(b.vpool, hv.data(), hv.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(b.q, hq.data(), hq.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(b.table, b.slots.data(), b.slots.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(b.flush, 1, kFlushBytes));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  std::printf("one CTA reading 16 query rows and n K / V rows (d = 128, fp16) and writing 8 KB; cold inputs (own "
              "copy per run, 512 MB read flush first), warm code; graph replays, median of %d runs (us)\n",
              kRuns);
  for (int n : token_counts) {
    const size_t out_bytes = static_cast<size_t>(total) * kRows * kD * 4;
    const float e = time_kind(b, 0, n, st);
    CK(cudaMemset(b.out, 0xff, out_bytes));  // poison: every checked value must come from the kernel
    const float tt = time_kind(b, 1, n, st);
    const bool ok_t = check_run(b, hq, hk, hv, 0, n);
    CK(cudaMemset(b.out, 0xff, out_bytes));
    const float tp = time_kind(b, 2, n, st);
    const bool ok_p = check_run(b, hq, hk, hv, 0, n);
    std::printf("tokens %2d: empty %.2f  slot table %.2f  slots in params %.2f  (table - empty %.2f, params - empty %.2f)\n",
                n, e, tt, tp, tt - e, tp - e);
    if (!ok_t || !ok_p) {
      std::fprintf(stderr, "output check failed (table %d, params %d)\n", ok_t, ok_p);
      return 1;
    }
  }
  return 0;
}
