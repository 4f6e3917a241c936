// Warpgroup MMA (wgmma, sm_90a) wrappers for the tree kernel's 64-row tiles (tree_attention_consumer.cuh).
// A warpgroup (4 consecutive warps, 128 threads) computes D[64 x N] (+)= A[64 x 16] B[16 x N] with
// fp32 accumulators; warp w of the group holds rows 16 w .. 16 w + 15 in the mma.sync C layout
// (ptx.cuh), n-tile j in d[j][0 .. 3]. Operands in shared memory are given by matrix
// descriptors (gmma_desc_at) of 128-byte-swizzled tiles (swz64 in tree_attention_common.cuh):
//   wgmma_rs     A from registers (the mma.sync m16n8k16 A layout per warp: Q fragments), B K-major
//                from shared memory (S = Q K^T: K [64 tokens][D]); scale_d = 0 overwrites D (first
//                k-step), 1 accumulates.
//   wgmma_rs_tb  A from registers (the mma.sync m16n8k16 A layout per warp: P), B from shared
//                memory N-major ("transposed": V [tokens][D] read as B[16 tokens x N = D]); accumulates.
// Every wgmma sequence is wgmma_fence() ... wgmma_commit(); wgmma_wait<0>(), with the accumulators
// passed through fence_regs() so the compiler keeps their reads and writes outside the async window.
// The wrappers share one asm template (FT_WGMMA_RS) over the accumulator-width and dtype variants.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace fasttree::cuda_detail {

// Descriptor of a 128B-swizzled shared-memory matrix (the PTX ISA "Matrix Descriptor Format"),
// built in two 32-bit halves: lo = start byte address >> 4 | leading byte offset (lbo) >> 4 << 16,
// hi = stride byte offset (sbo) >> 4 | 128-byte swizzle (lbo, sbo multiples of 16). Operands are
// stepped through by constant byte offsets: gmma_desc_lo(saddr, lbo) once per tile, then
// gmma_desc_at(lo, gmma_desc_hi(sbo), off) per wgmma is one integer add (the 14-bit address
// field cannot carry into lbo: shared addresses stay below 228 KB < 256 KB). Recomputing the masked, shifted address for every k-step cost
// ~10 uniform-datapath instructions between consecutive wgmmas, more issue time than the
// tensor cores took for an m64n64k16 (PERF_NOTES.md, session 10).
__device__ __forceinline__ uint32_t gmma_desc_lo(uint32_t saddr, uint32_t lbo) {
  return ((saddr & 0x3ffff) >> 4) | (((lbo >> 4) & 0x3fff) << 16);
}
__host__ __device__ constexpr uint32_t gmma_desc_hi(uint32_t sbo) { return ((sbo >> 4) & 0x3fff) | (1u << 30); }
__device__ __forceinline__ uint64_t gmma_desc_at(uint32_t lo, uint32_t hi, uint32_t byte_off) {
  return (static_cast<uint64_t>(hi) << 32) | (lo + (byte_off >> 4));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}
// Orders the generic-proxy writes this thread observed (cp.async data published through an
// mbarrier) before its later async-proxy reads (wgmma operands) of shared memory.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Operand lists of one wgmma with N accumulator columns (N = 64 or 128): the "+f" accumulators
// d[0][0] .. d[N / 8 - 1][3] (%0 .. %(N / 2 - 1)), then A's four registers, B's descriptor and the
// source of the scale-d predicate.
#define FT_WGMMA_ACC64(d) "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define FT_WGMMA_ACC128(d) FT_WGMMA_ACC64(d), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define FT_WGMMA_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FT_WGMMA_D128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FT_WGMMA_AB64 "{%32, %33, %34, %35}, %36"
#define FT_WGMMA_AB128 "{%64, %65, %66, %67}, %68"
#define FT_WGMMA_P64 "%37"
#define FT_WGMMA_P128 "%69"
// m64nNk16 with A from registers, TYPE f16 / bf16, TNSPB "1" for an N-major B (V) and "0" for a
// K-major one (K), SCALE_D the scale-d operand (0: overwrite D).
#define FT_WGMMA_RS(N, TYPE, TNSPB, SCALE_D)                                                                  \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, " FT_WGMMA_P##N ", 0;\n"                               \
               " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " FT_WGMMA_D##N ", "      \
               FT_WGMMA_AB##N ", p, 1, 1, " TNSPB ";\n}\n"                                                 \
               : FT_WGMMA_ACC##N(d)                                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), SCALE_D)

template <class T, int N>
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b) {
  static_assert(N == 64 || N == 128, "P V tiles are 64 or 128 columns wide");
  if constexpr (N == 64) {
    if constexpr (std::is_same_v<T, __half>) FT_WGMMA_RS(64, "f16", "1", "n"(1));
    else FT_WGMMA_RS(64, "bf16", "1", "n"(1));
  } else {
    if constexpr (std::is_same_v<T, __half>) FT_WGMMA_RS(128, "f16", "1", "n"(1));
    else FT_WGMMA_RS(128, "bf16", "1", "n"(1));
  }
}

template <class T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  static_assert(N == 64, "S tiles are 64 columns wide");
  if constexpr (std::is_same_v<T, __half>) FT_WGMMA_RS(64, "f16", "0", "r"(scale_d));
  else FT_WGMMA_RS(64, "bf16", "0", "r"(scale_d));
}

#undef FT_WGMMA_RS
#undef FT_WGMMA_P128
#undef FT_WGMMA_P64
#undef FT_WGMMA_AB128
#undef FT_WGMMA_AB64
#undef FT_WGMMA_D128
#undef FT_WGMMA_D64
#undef FT_WGMMA_ACC128
#undef FT_WGMMA_ACC64
}  // namespace fasttree::cuda_detail
