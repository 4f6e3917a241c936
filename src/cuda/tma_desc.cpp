#include "cuda/tma_desc.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>

namespace fasttree::cuda_detail {
namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled through the runtime (the binaries do not link libcuda);
// nullptr where the driver lacks it.
EncodeTiled encode_fn() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // clear the sticky-free error state of a failed query
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(f);
  }();
  return fn;
}

// The 3-d tensor (dims[0] contiguous 16-bit elements; strides of dims 1 and 2 in elements) with
// boxes `box` in the 128-byte swizzle.
bool encode_3d(TmaDesc& out, const void* base, bool bf16, const int64_t (&dims)[3], const int64_t (&strides)[2],
               const int (&box)[3]) {
  static_assert(sizeof(CUtensorMap) == sizeof(TmaDesc) && alignof(TmaDesc) >= 64);
  const EncodeTiled fn = encode_fn();
  if (fn == nullptr || base == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  for (int i = 0; i < 3; ++i)
    if (dims[i] < 1 || box[i] < 1 || box[i] > 256) return false;
  if ((strides[0] * 2) % 16 != 0 || (strides[1] * 2) % 16 != 0) return false;
  const cuuint64_t d[3] = {static_cast<cuuint64_t>(dims[0]), static_cast<cuuint64_t>(dims[1]), static_cast<cuuint64_t>(dims[2])};
  const cuuint64_t st[2] = {static_cast<cuuint64_t>(strides[0] * 2), static_cast<cuuint64_t>(strides[1] * 2)};
  const cuuint32_t bx[3] = {static_cast<cuuint32_t>(box[0]), static_cast<cuuint32_t>(box[1]), static_cast<cuuint32_t>(box[2])};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult r = fn(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                        const_cast<void*>(base), d, st, bx, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return false;
  std::memcpy(&out, &map, sizeof(map));
  return true;
}

}  // namespace

bool encode_kv_tma(TmaDesc& out, const void* base, bool bf16, int64_t head_dim, int64_t num_kv_heads, int64_t slots,
                   int64_t row_stride, int64_t head_stride, int box_slots) {
  if (head_dim % 64 != 0) return false;
  const int64_t s = slots > 0 ? slots : int64_t{0x7fffffff};
  return encode_3d(out, base, bf16, {head_dim, s, num_kv_heads}, {row_stride, head_stride}, {64, box_slots, 1});
}

bool encode_q_tma(TmaDesc& out, const void* base, bool bf16, int64_t head_dim, int64_t num_qo_heads, int64_t num_queries,
                  int g, int box_queries) {
  if (head_dim % 64 != 0 || g < 1 || box_queries < 1 || int64_t{g} * box_queries > 256) return false;
  return encode_3d(out, base, bf16, {head_dim, num_qo_heads, num_queries}, {head_dim, num_qo_heads * head_dim},
                   {64, g, box_queries});
}

}  // namespace fasttree::cuda_detail
