// Probe: where does a TMA tile load with the 128-byte swizzle put its rows when the shared-memory
// destination is not 1024-byte aligned (a box starting at row r0 % 8 != 0 of a swizzled tile)?
// The tree kernel's producer copies K/V rows that cross slot runs by cp.async (many instructions
// per row); if the swizzle follows the destination address bits (chunk ^= (address / 128) % 8),
// any run of rows can be loaded by TMA boxes at any row of the tile (PERF_NOTES.md, session 12).
//
// Built by CMake with the benchmarks (FASTTREE_BENCH, CUDA): build-gpu/tma_swizzle_probe.
// Prints, per box height and start row, whether the rows landed as address-swizzled,
// box-swizzled, or neither (or the launch error); exits 0 only if every box was address-swizzled.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

constexpr int kRows = 256, kCols = 64, kG0 = 5;

__global__ void probe(const __grid_constant__ CUtensorMap map, int r0, int h, uint16_t* out) {
  __shared__ __align__(1024) unsigned char sm[4096];
  __shared__ __align__(8) uint64_t bar;
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) sm[i] = 0xff;
  __syncthreads();
  const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(&bar));
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(sm)) + r0 * 128;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b));
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(h * 128) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"(&map), "r"(0), "r"(kG0), "r"(b)
        : "memory");
    uint32_t done = 0;
    while (!done) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done)
                   : "r"(b)
                   : "memory");
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 2048; i += blockDim.x) out[i] = reinterpret_cast<const uint16_t*>(sm)[i];
}

int main() {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess || f == nullptr) {
    std::printf("no cuTensorMapEncodeTiled\n");
    return 1;
  }
  const auto encode = reinterpret_cast<EncodeTiled>(f);
  std::vector<uint16_t> host(kRows * kCols);
  for (int i = 0; i < kRows * kCols; ++i) host[i] = static_cast<uint16_t>(i);
  uint16_t *g = nullptr, *out = nullptr;
  cudaMalloc(&g, host.size() * 2);
  cudaMalloc(&out, 4096);
  cudaMemcpy(g, host.data(), host.size() * 2, cudaMemcpyHostToDevice);
  bool all_addr = true;
  for (int h : {16, 8, 5, 1}) {
    CUtensorMap map;
    const cuuint64_t dims[2] = {kCols, kRows};
    const cuuint64_t strides[1] = {kCols * 2};
    const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(h)};
    const cuuint32_t es[2] = {1, 1};
    if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, g, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      std::printf("h=%d: encode failed\n", h);
      continue;
    }
    for (int r0 = 0; r0 < 8; ++r0) {
      probe<<<1, 128>>>(map, r0, h, out);
      const cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) {
        std::printf("h=%d r0=%d: %s\n", h, r0, cudaGetErrorString(e));
        return 1;
      }
      std::vector<uint16_t> sm(2048);
      cudaMemcpy(sm.data(), out, 4096, cudaMemcpyDeviceToHost);
      bool addr = true, boxr = true;
      for (int i = 0; i < h; ++i)
        for (int c = 0; c < 8; ++c)
          for (int e2 = 0; e2 < 8; ++e2) {
            const uint16_t want = static_cast<uint16_t>((kG0 + i) * kCols + c * 8 + e2);
            const int row = r0 + i;
            if (sm[row * 64 + ((c ^ (row & 7)) * 8) + e2] != want) addr = false;
            if (sm[row * 64 + ((c ^ (i & 7)) * 8) + e2] != want) boxr = false;
          }
      std::printf("h=%d r0=%d: %s\n", h, r0, addr && boxr ? "both" : addr ? "address-swizzled" : boxr ? "box-swizzled" : "neither");
      all_addr = all_addr && addr;
    }
  }
  std::printf("%s\n", all_addr ? "every box landed address-swizzled" : "some box did not land address-swizzled");
  return all_addr ? 0 : 2;
}
