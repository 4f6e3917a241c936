#include "cuda/random_run.h"

#include <algorithm>

#include "core/error.h"
#include "core/tree_gen.h"

#ifdef FASTTREE_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_check.h"
#include "cuda/kernels.h"
#include "cuda/tree_attention.h"
#endif

namespace fasttree {

#ifndef FASTTREE_HAVE_CUDA
RandomRunResult cuda_run_random_inputs(const Plan&, const KvTree&, const AttnShape&, KvDType, uint64_t, bool) {
  FT_FAIL("CUDA backend not available: this binary was built without nvcc");
}
#else

namespace {

template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  int64_t n = 0;
  explicit DeviceArray(int64_t count) : n(count) {
    FT_CUDA_CHECK(cudaMalloc(&ptr, static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T)));
  }
  ~DeviceArray() { (void)cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  std::vector<T> to_host() const {
    std::vector<T> h(static_cast<size_t>(n));
    if (n > 0) FT_CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

}  // namespace

RandomRunResult cuda_run_random_inputs(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype,
                                       uint64_t seed, bool head_major) {
  FT_CHECK(cuda_device_count() > 0, "cuda_run_random_inputs: no CUDA device available");
  shape.validate();
  const int64_t nq = tree.num_queries(), q_row = static_cast<int64_t>(shape.num_qo_heads) * shape.head_dim;
  const int64_t num_slots = std::max<int64_t>(1, max_slot_plus_one(tree));
  const int64_t kv_row = static_cast<int64_t>(shape.num_kv_heads) * shape.head_dim;
  const int dt = dtype == KvDType::kF16 ? cuda_detail::kDTypeF16 : cuda_detail::kDTypeBF16;
  DeviceArray<uint16_t> q(nq * q_row), k(num_slots * kv_row), v(num_slots * kv_row);
  DeviceArray<float> out(nq * q_row), lse(nq * shape.num_qo_heads);
  FT_CUDA_CHECK(cuda_detail::fill_uniform_launch(dt, q.ptr, q.n, seed * 3 + 1, nullptr));
  FT_CUDA_CHECK(cuda_detail::fill_uniform_launch(dt, k.ptr, k.n, seed * 3 + 2, nullptr));
  FT_CUDA_CHECK(cuda_detail::fill_uniform_launch(dt, v.ptr, v.n, seed * 3 + 3, nullptr));
  FT_CUDA_CHECK(cudaMemset(out.ptr, 0xff, static_cast<size_t>(std::max<int64_t>(out.n, 1)) * sizeof(float)));
  FT_CUDA_CHECK(cudaMemset(lse.ptr, 0xff, static_cast<size_t>(std::max<int64_t>(lse.n, 1)) * sizeof(float)));
  CudaTreeAttentionOptions opt;
  if (head_major) {
    opt.kv_layout = KvLayout::kHeadMajor;
    opt.kv_slots = num_slots;
  }
  CudaTreeAttention att(shape, dtype, 0.0f, opt);
  att.upload(plan, tree, nullptr, num_slots);
  att.poison_workspace(nullptr);
  att.run(q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, nullptr);
  FT_CUDA_CHECK(cudaDeviceSynchronize());
  FT_CUDA_CHECK(cudaGetLastError());
  RandomRunResult r;
  r.num_slots = num_slots;
  r.q = q.to_host();
  r.k = k.to_host();
  r.v = v.to_host();
  if (head_major) {  // the same random values, read as [Hkv, S, d]: hand them back as [S, Hkv, d]
    r.k = swap_outer_dims(r.k, shape.num_kv_heads, num_slots, shape.head_dim);
    r.v = swap_outer_dims(r.v, shape.num_kv_heads, num_slots, shape.head_dim);
  }
  r.out = out.to_host();
  r.lse = lse.to_host();
  return r;
}

#endif

}  // namespace fasttree
