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

}  // namespace

bool encode_kv_tma(TmaDesc& out, const void* base, bool bf16, int64_t head_dim, int64_t num_kv_heads, int64_t slots,
                   int64_t row_stride, int64_t head_stride, int box_slots) {
  static_assert(sizeof(CUtensorMap) == sizeof(TmaDesc) && alignof(TmaDesc) >= 64);
  const EncodeTiled fn = encode_fn();
  if (fn == nullptr || base == nullptr || head_dim % 64 != 0 || num_kv_heads < 1 || box_slots < 1 || box_slots > 256)
    return false;
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || (row_stride * 2) % 16 != 0 || (head_stride * 2) % 16 != 0)
    return false;
  const int64_t s = slots > 0 ? slots : int64_t{0x7fffffff};
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(s),
                              static_cast<cuuint64_t>(num_kv_heads)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(row_stride * 2), static_cast<cuuint64_t>(head_stride * 2)};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(box_slots), 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  CUtensorMap map;
  const CUresult r = fn(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
                        const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return false;
  std::memcpy(&out, &map, sizeof(map));
  return true;
}

}  // namespace fasttree::cuda_detail
