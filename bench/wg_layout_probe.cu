// Microbenchmark: how fast the tree kernel's 64 x 64 tile chain (S = Q K^T on wgmma with Q in
// registers, online softmax in fp32, O += P V on wgmma; d = 128, fp16) runs with 1, 2 or 3 consumer
// warpgroups per CTA sharing each K/V stage, so that the layout question of PERF_NOTES.md
// (sessions 11, 18, 19: more consumer warps per SM) is answered on the plain dense case before the
// tree kernel is rebuilt around it.
//
// Layouts (all d = 128, 64-token K/V tiles loaded by TMA into an mbarrier ring):
//   W = 1: the tree kernel's: 4 consumer warps + 1 producer warp, 2 CTAs per SM, 3 stages.
//   W = 2: FlashAttention-3's: 2 consumer warpgroups + 1 producer warpgroup, 1 CTA per SM; setmaxnreg
//          gives the consumers 232 registers and the producer 40.
//   W = 3: 3 consumer warpgroups + 1 producer warpgroup, 1 CTA per SM; consumers 160, producer 32.
// Each CTA walks row blocks of 64 W rows (warpgroup w takes rows [64 w, +64)); every block reads all
// `tokens` K/V rows, so a stage is loaded once for the W warpgroups. Q [rows][128], K / V
// [tokens][128] fp16 random, O [rows][128] fp32; sampled rows are checked against fp64.
//
// Built by CMake with the benchmarks (FASTTREE_BENCH, CUDA): build-gpu/wg_layout_probe.
// Usage: wg_layout_probe [rows tokens]   (default 50688 2048; rows a multiple of 384, tokens of 128)
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/ptx.cuh"
#include "cuda/wgmma.cuh"
#include "cuda_check_exit.h"

using fasttree::cuda_detail::fast_exp2;
using fasttree::cuda_detail::fence_proxy_async;
using fasttree::cuda_detail::fence_regs;
using fasttree::cuda_detail::fence_mbarrier_init;
using fasttree::cuda_detail::gmma_desc_at;
using fasttree::cuda_detail::gmma_desc_hi;
using fasttree::cuda_detail::gmma_desc_lo;
using fasttree::cuda_detail::mbar_arrive;
using fasttree::cuda_detail::mbar_arrive_expect_tx;
using fasttree::cuda_detail::mbar_init;
using fasttree::cuda_detail::mbar_wait;
using fasttree::cuda_detail::pack2;
using fasttree::cuda_detail::smem_addr;
using fasttree::cuda_detail::tma_load_3d;
using fasttree::cuda_detail::wgmma_commit;
using fasttree::cuda_detail::wgmma_fence;
using fasttree::cuda_detail::wgmma_rs;
using fasttree::cuda_detail::wgmma_rs_tb;
using fasttree::cuda_detail::wgmma_wait;


namespace {

constexpr int kD = 128, kN = 64;
constexpr uint32_t kBlk = 64 * 64 * 2;        // one [64 rows][64 columns] swizzled block
constexpr int kStageBytes = 2 * kN * kD * 2;  // K tile + V tile (32 KB)
constexpr float kSlack = 8.0f;                // lazy rescale threshold (the tree kernel's kRescaleSlack)

struct Params {
  CUtensorMap tk, tv;  // (d, token, 1) boxes of 64 x 64 x 1, 128-byte swizzle
  const __half* q;     // [rows][128]
  float* o;            // [rows][128]
  int rows, tokens;
  float scale_log2;
};

template <int W>
struct Layout {
  static constexpr int kThreads = W == 1 ? 160 : (W + 1) * 128;
  static constexpr int kMinBlocks = W == 1 ? 2 : 1;
  static constexpr int kStages = W == 1 ? 3 : 6;
  static constexpr int kSmem = kStages * kStageBytes + 2 * kStages * 8 + 1024;
  static constexpr int kConsRegs = W == 2 ? 232 : 160;
  static constexpr int kProdRegs = W == 2 ? 40 : 32;
};

// kPair: each consumer step takes two consecutive stages as one 64 x 128 tile (S of both, one
// softmax over 128 columns, 8 P V k-steps), as FT_TREE_PAIR does in the tree kernel.
// kPing (W = 2): FlashAttention-3's ping-pong: the two warpgroups issue their S and their P V
// wgmmas in strictly alternating sections (named barriers 8 + wg), so one's softmax runs under the
// other's wgmmas instead of both contending at once.
__device__ __forceinline__ void bar_sync_n(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive_n(int id, int n) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

template <int W, bool kPair = false, bool kPing = false>
__global__ void __launch_bounds__(Layout<W>::kThreads, Layout<W>::kMinBlocks) probe(const __grid_constant__ Params p) {
  static_assert(!kPing || W == 2);
  using L = Layout<W>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kStages * kStageBytes);
  uint64_t* empty = full + L::kStages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nblocks = p.rows / (64 * W), ntiles = p.tokens / kN;
  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], W * 128);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  if (warp >= 4 * W) {  // producer (warp 4 W; the rest of its warpgroup idles)
    if constexpr (W > 1) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(L::kProdRegs));
    if (warp != 4 * W || lane != 0) return;
    int it = 0;
    for (int b = blockIdx.x; b < nblocks; b += gridDim.x)
      for (int t = 0; t < ntiles; ++t, ++it) {
        const int stage = it % L::kStages, k = it / L::kStages;
        if (k > 0) mbar_wait(&empty[stage], (k - 1) & 1);
        const uint32_t base = smem_addr(smem + stage * kStageBytes);
        mbar_arrive_expect_tx(&full[stage], kStageBytes);
        for (int c = 0; c < 2; ++c) {
          tma_load_3d(base + c * kBlk, &p.tk, 64 * c, t * kN, 0, &full[stage]);
          tma_load_3d(base + 2 * kBlk + c * kBlk, &p.tv, 64 * c, t * kN, 0, &full[stage]);
        }
      }
    return;
  }
  if constexpr (W > 1) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(L::kConsRegs));
  const int wg = warp / 4, wq = warp % 4, g = lane >> 2, tq = lane & 3;
  float o[16][4];
  float m[2], l[2];
  uint32_t qf[8][4];
  int it = 0;
  if (kPing && wg == 1) bar_arrive_n(8, 256);  // warpgroup 0 issues first
  for (int b = blockIdx.x; b < nblocks; b += gridDim.x) {
    const int row0 = b * 64 * W + wg * 64 + wq * 16 + g;  // rows row0 and row0 + 8
    const uint32_t* q0 = reinterpret_cast<const uint32_t*>(p.q + static_cast<int64_t>(row0) * kD + 2 * tq);
    const uint32_t* q1 = q0 + 8 * kD / 2;
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      qf[kk][0] = __ldg(q0 + kk * 8);
      qf[kk][1] = __ldg(q1 + kk * 8);
      qf[kk][2] = __ldg(q0 + kk * 8 + 4);
      qf[kk][3] = __ldg(q1 + kk * 8 + 4);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
    constexpr int kP = kPair ? 2 : 1;  // stages per step
    for (int t = 0; t < ntiles; t += kP, it += kP) {
      uint32_t kb[kP], vb[kP];
#pragma unroll
      for (int h = 0; h < kP; ++h) {
        const int stage = (it + h) % L::kStages;
        mbar_wait(&full[stage], ((it + h) / L::kStages) & 1);
        kb[h] = smem_addr(smem + stage * kStageBytes);
        vb[h] = kb[h] + 2 * kBlk;
      }
      float sc[8 * kP][4];
#pragma unroll
      for (int i = 0; i < 8 * kP; ++i) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;
      fence_proxy_async();
      fence_regs(sc);
      if constexpr (kPing) bar_sync_n(8 + wg, 256);
      wgmma_fence();
      constexpr uint32_t kHi = gmma_desc_hi(1024);
#pragma unroll
      for (int h = 0; h < kP; ++h) {
        float(&sh)[8][4] = *reinterpret_cast<float(*)[8][4]>(&sc[8 * h][0]);
        const uint32_t kd = gmma_desc_lo(kb[h], 16);
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
          wgmma_rs<__half, 64>(sh, qf[kk], gmma_desc_at(kd, kHi, (kk / 4) * kBlk + (kk % 4) * 32), kk > 0 ? 1 : 0);
      }
      wgmma_commit();
      if constexpr (kPing) bar_arrive_n(8 + (wg ^ 1), 256);
      wgmma_wait<0>();
      fence_regs(sc);
      // Online softmax (log2 domain, lazy rescale), rows g and g + 8 of the warp's 16.
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int i = 0; i < 8 * kP; ++i) {
        mx[0] = fmaxf(mx[0], fmaxf(sc[i][0], sc[i][1]));
        mx[1] = fmaxf(mx[1], fmaxf(sc[i][2], sc[i][3]));
      }
      float mu[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mt = mx[r] * p.scale_log2;
        const float mn = mt > m[r] + kSlack ? mt : m[r];
        mu[r] = mn;
        alpha[r] = fast_exp2(m[r] - mn);
        m[r] = mn;
      }
      float rs[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 8 * kP; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sc[i][e] = fast_exp2(fmaf(sc[i][e], p.scale_log2, -mu[e >> 1]));
          rs[e >> 1] += sc[i][e];
        }
      l[0] = fmaf(l[0], alpha[0], rs[0]);
      l[1] = fmaf(l[1], alpha[1], rs[1]);
      if (t > 0 && __any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          o[i][0] *= alpha[0];
          o[i][1] *= alpha[0];
          o[i][2] *= alpha[1];
          o[i][3] *= alpha[1];
        }
      }
      uint32_t pa[4 * kP][4];
#pragma unroll
      for (int j = 0; j < 4 * kP; ++j) {
        pa[j][0] = pack2<__half>(sc[2 * j][0], sc[2 * j][1]);
        pa[j][1] = pack2<__half>(sc[2 * j][2], sc[2 * j][3]);
        pa[j][2] = pack2<__half>(sc[2 * j + 1][0], sc[2 * j + 1][1]);
        pa[j][3] = pack2<__half>(sc[2 * j + 1][2], sc[2 * j + 1][3]);
      }
      fence_regs(o);
      if constexpr (kPing) bar_sync_n(8 + wg, 256);
      wgmma_fence();
#pragma unroll
      for (int h = 0; h < kP; ++h) {
        const uint32_t vd = gmma_desc_lo(vb[h], kBlk);
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_rs_tb<__half, kD>(o, pa[4 * h + j], gmma_desc_at(vd, kHi, j * 16 * 128));
      }
      wgmma_commit();
      if constexpr (kPing) bar_arrive_n(8 + (wg ^ 1), 256);
      wgmma_wait<0>();
      fence_regs(o);
#pragma unroll
      for (int h = 0; h < kP; ++h) mbar_arrive(&empty[(it + h) % L::kStages]);
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float lt = l[hr];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const float inv = 1.0f / lt;
      float* orow = p.o + static_cast<int64_t>(row0 + 8 * hr) * kD + 2 * tq;
#pragma unroll
      for (int i = 0; i < 16; ++i)
        *reinterpret_cast<float2*>(orow + i * 8) = make_float2(o[i][2 * hr] * inv, o[i][2 * hr + 1] * inv);
    }
  }
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

CUtensorMap encode(const __half* base, int tokens) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    std::fprintf(stderr, "no cuTensorMapEncodeTiled in the driver\n");
    std::exit(1);
  }
  const cuuint64_t dims[3] = {kD, static_cast<cuuint64_t>(tokens), 1};
  const cuuint64_t strides[2] = {kD * 2, static_cast<cuuint64_t>(tokens) * kD * 2};
  const cuuint32_t box[3] = {64, 64, 1}, es[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult r = reinterpret_cast<EncodeTiled>(f)(&map, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3, const_cast<__half*>(base), dims, strides,
                                                      box, es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed (%d)\n", static_cast<int>(r));
    std::exit(1);
  }
  return map;
}

// Times layout W (median of `reps` CUDA-event timings after warm-up) and checks sampled rows
// against fp64; returns false on a mismatch.
template <int W, bool kPair = false, bool kPing = false>
bool run(const Params& base, int sms, const std::vector<__half>& hq, const std::vector<__half>& hk,
         const std::vector<__half>& hv, float scale) {
  using L = Layout<W>;
  CK(cudaFuncSetAttribute(probe<W, kPair, kPing>, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kSmem));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, probe<W, kPair, kPing>, L::kThreads, L::kSmem));
  cudaFuncAttributes fa{};
  CK(cudaFuncGetAttributes(&fa, probe<W, kPair, kPing>));
  Params p = base;
  const int grid = sms * std::max(1, per_sm);
  CK(cudaMemset(p.o, 0xff, static_cast<size_t>(p.rows) * kD * 4));  // poison (NaN)
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int rep = 0; rep < 25; ++rep) {
    CK(cudaEventRecord(e0));
    probe<W, kPair, kPing><<<grid, L::kThreads, L::kSmem>>>(p);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaGetLastError());
    float t = 0;
    CK(cudaEventElapsedTime(&t, e0, e1));
    if (rep >= 5) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const double us = ms[ms.size() / 2] * 1e3;
  const double tflops = 4.0 * p.rows * static_cast<double>(p.tokens) * kD / (us * 1e-6) / 1e12;
  // fp64 check of sampled rows
  std::vector<float> out(static_cast<size_t>(p.rows) * kD);
  CK(cudaMemcpy(out.data(), p.o, out.size() * 4, cudaMemcpyDeviceToHost));
  double max_err = 0;
  std::mt19937 rng(7);
  for (int s = 0; s < 24; ++s) {
    const int r = static_cast<int>(rng() % p.rows);
    std::vector<double> sc(p.tokens), acc(kD, 0.0);
    double mx = -1e300, sum = 0;
    for (int t = 0; t < p.tokens; ++t) {
      double d = 0;
      for (int c = 0; c < kD; ++c) d += static_cast<double>(__half2float(hq[static_cast<size_t>(r) * kD + c])) *
                                      __half2float(hk[static_cast<size_t>(t) * kD + c]);
      sc[t] = d * scale;
      mx = std::max(mx, sc[t]);
    }
    for (int t = 0; t < p.tokens; ++t) {
      const double w = std::exp(sc[t] - mx);
      sum += w;
      for (int c = 0; c < kD; ++c) acc[c] += w * __half2float(hv[static_cast<size_t>(t) * kD + c]);
    }
    for (int c = 0; c < kD; ++c) {
      const double ref = acc[c] / sum, got = out[static_cast<size_t>(r) * kD + c];
      const double err = std::fabs(got - ref) / std::max(1e-2, std::fabs(ref));
      max_err = std::max(max_err, std::isfinite(got) ? err : 1e30);
    }
  }
  std::printf("W=%d%s%s,%d,%d,%d,%d,%.1f,%.0f,%.1e\n", W, kPair ? "+pair" : "", kPing ? "+ping" : "", L::kThreads, per_sm, fa.numRegs, L::kStages, us, tflops, max_err);
  return max_err < 2e-2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 1 && argc != 3) {
    std::fprintf(stderr, "usage: wg_layout_probe [rows tokens]\n");
    return 2;
  }
  const int rows = argc == 3 ? std::atoi(argv[1]) : 50688, tokens = argc == 3 ? std::atoi(argv[2]) : 2048;
  if (rows <= 0 || tokens <= 0 || rows % 384 != 0 || tokens % 128 != 0) {
    std::fprintf(stderr, "rows must be a positive multiple of 384 and tokens of 128\n");
    return 2;
  }
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<__half> hq(static_cast<size_t>(rows) * kD), hk(static_cast<size_t>(tokens) * kD), hv(hk.size());
  for (auto& x : hq) x = __float2half(u(rng));
  for (auto& x : hk) x = __float2half(u(rng));
  for (auto& x : hv) x = __float2half(u(rng));
  __half *dq, *dk, *dv;
  float* dout;
  CK(cudaMalloc(&dq, hq.size() * 2));
  CK(cudaMalloc(&dk, hk.size() * 2));
  CK(cudaMalloc(&dv, hv.size() * 2));
  CK(cudaMalloc(&dout, static_cast<size_t>(rows) * kD * 4));
  CK(cudaMemcpy(dq, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
  const float scale = 1.0f / std::sqrt(static_cast<float>(kD));
  Params p{encode(dk, tokens), encode(dv, tokens), dq, dout, rows, tokens, scale * 1.4426950408889634f};
  std::printf("layout,threads,ctas_per_sm,registers,stages,us,tflops,max_rel_err   (rows %d, tokens %d, d 128, fp16)\n", rows, tokens);
  bool ok = run<1>(p, sms, hq, hk, hv, scale);
  ok = run<2>(p, sms, hq, hk, hv, scale) && ok;
  ok = run<3>(p, sms, hq, hk, hv, scale) && ok;
  ok = run<2, true>(p, sms, hq, hk, hv, scale) && ok;
  ok = run<2, false, true>(p, sms, hq, hk, hv, scale) && ok;
  ok = run<2, true, true>(p, sms, hq, hk, hv, scale) && ok;
  return ok ? 0 : 1;
}
