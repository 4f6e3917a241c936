// CUDA backend entry points on host arrays (runtime API only; never links libcuda directly).
#include "cuda/backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/tree_gen.h"
#include "cuda/cuda_check.h"
#include "cuda/host_resources.h"
#include "cuda/kernels.h"
#include "plan/per_request_plan.h"
#include "cuda/tree_attention.h"

namespace fasttree {

namespace {

using cuda_detail::DeviceBuffer;
using cuda_detail::Graph;
using cuda_detail::Stream;

std::string str(int64_t x) { return std::to_string(x); }

std::vector<uint16_t> to_dtype(std::span<const float> x, KvDType t) {
  std::vector<uint16_t> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = t == KvDType::kF16 ? float_to_half(x[i]) : float_to_bf16(x[i]);
  return y;
}

int64_t check_spans(const KvTree& tree, const AttnShape& shape, std::span<const float> q, std::span<const float> k,
                    std::span<const float> v, std::span<float> out, std::span<float> lse) {
  shape.validate();
  const int64_t nq = tree.num_queries(), hq = shape.num_qo_heads, hkv = shape.num_kv_heads, d = shape.head_dim;
  FT_CHECK(q.size() == static_cast<size_t>(nq * hq * d), "cuda_attention: q has " + str(q.size()) + " floats, expected " + str(nq * hq * d));
  FT_CHECK(out.size() == q.size(), "cuda_attention: out has " + str(out.size()) + " floats, expected " + str(q.size()));
  FT_CHECK(lse.empty() || lse.size() == static_cast<size_t>(nq * hq),
           "cuda_attention: lse has " + str(lse.size()) + " floats, expected 0 or " + str(nq * hq));
  FT_CHECK(k.size() % static_cast<size_t>(hkv * d) == 0 && v.size() == k.size(),
           "cuda_attention: k/v sizes must be equal multiples of Hkv*d = " + str(hkv * d));
  return static_cast<int64_t>(k.size()) / (hkv * d);
}

void run_on_device(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype, std::span<const float> q,
                   std::span<const float> k, std::span<const float> v, float sm_scale, std::span<float> out,
                   std::span<float> lse, const CudaRunOptions& options) {
  FT_CHECK(cuda_device_count() > 0, "cuda_attention: no CUDA device available");
  const int64_t num_slots = check_spans(tree, shape, q, k, v, out, lse);
  FT_CHECK(options.repeats >= 1, "cuda_attention: repeats must be >= 1");
  Stream st;
  DeviceBuffer dq(q.size() * 2), dk(k.size() * 2), dv(v.size() * 2), dout(out.size() * 4), dlse(lse.size() * 4);
  {
    std::vector<uint16_t> hq = to_dtype(q, dtype), hk = to_dtype(k, dtype), hv = to_dtype(v, dtype);
    if (options.kv_head_major) {  // [S, Hkv, d] -> [Hkv, S, d]
      hk = swap_outer_dims(hk, num_slots, shape.num_kv_heads, shape.head_dim);
      hv = swap_outer_dims(hv, num_slots, shape.num_kv_heads, shape.head_dim);
    }
    if (!hq.empty()) FT_CUDA_CHECK(cudaMemcpy(dq.ptr, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
    if (!hk.empty()) FT_CUDA_CHECK(cudaMemcpy(dk.ptr, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
    if (!hv.empty()) FT_CUDA_CHECK(cudaMemcpy(dv.ptr, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
  }
  CudaTreeAttentionOptions opt = cuda_detail::shared_kernel_options(options, num_slots);
  opt.merge_wide = options.merge_wide;
  opt.use_tma_q = options.use_tma_q;
  opt.fit_grid = options.fit_grid;
  CudaTreeAttention att(shape, dtype, sm_scale, opt);
  att.upload(plan, tree, st.s, num_slots);
  // Poisoned before every repeat, so that a repeat that leaves something unwritten fails too.
  auto poison = [&] {
    if (!options.poison_outputs) return;
    if (!out.empty()) FT_CUDA_CHECK(cudaMemsetAsync(dout.ptr, 0xff, out.size() * 4, st.s));
    if (!lse.empty()) FT_CUDA_CHECK(cudaMemsetAsync(dlse.ptr, 0xff, lse.size() * 4, st.s));
    att.poison_workspace(st.s);
  };
  float* lse_ptr = lse.empty() ? nullptr : dlse.as<float>();
  auto enqueue = [&] { att.run(dq.ptr, dk.ptr, dv.ptr, dout.as<float>(), lse_ptr, st.s); };
  if (options.use_graph) {
    Graph graph(st.s, enqueue);
    for (int i = 0; i < options.repeats; ++i) {
      poison();
      FT_CUDA_CHECK(cudaGraphLaunch(graph.exec, st.s));
    }
    FT_CUDA_CHECK(cudaStreamSynchronize(st.s));
  } else {
    for (int i = 0; i < options.repeats; ++i) {
      poison();
      enqueue();
    }
    FT_CUDA_CHECK(cudaStreamSynchronize(st.s));
  }
  FT_CUDA_CHECK(cudaGetLastError());
  FT_CHECK(!options.require_tma || att.num_units() == 0 || att.tma_active(), "cuda_attention: TMA was required but the K/V tiles used cp.async");
  FT_CHECK(!options.require_tma_q || att.num_units() == 0 || att.tma_q_active(),
           "cuda_attention: Q by TMA was required but the kernel had no Q maps");
  if (!out.empty()) FT_CUDA_CHECK(cudaMemcpy(out.data(), dout.ptr, out.size() * 4, cudaMemcpyDeviceToHost));
  if (!lse.empty()) FT_CUDA_CHECK(cudaMemcpy(lse.data(), dlse.ptr, lse.size() * 4, cudaMemcpyDeviceToHost));
}

}  // namespace

bool cuda_backend_built() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

void cuda_set_device(int device) {
  const int n = cuda_device_count();
  FT_CHECK(device >= 0 && device < n, "CUDA device " + std::to_string(device) + " is missing (" + std::to_string(n) +
                                          " visible)");
  FT_CUDA_CHECK(cudaSetDevice(device));
}

std::vector<uint16_t> swap_outer_dims(const std::vector<uint16_t>& x, int64_t a, int64_t b, int64_t d) {
  FT_CHECK(static_cast<int64_t>(x.size()) == a * b * d, "swap_outer_dims: " + std::to_string(x.size()) +
                                                            " elements, expected " + std::to_string(a * b * d));
  std::vector<uint16_t> y(x.size());
  for (int64_t i = 0; i < a; ++i)
    for (int64_t j = 0; j < b; ++j) std::copy_n(x.begin() + (i * b + j) * d, d, y.begin() + (j * a + i) * d);
  return y;
}

void cuda_attention(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype,
                    std::span<const float> q, std::span<const float> k, std::span<const float> v, float sm_scale,
                    std::span<float> out, std::span<float> lse, const CudaRunOptions& options) {
  run_on_device(plan, tree, shape, dtype, q, k, v, sm_scale, out, lse, options);
}

void cuda_attention(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype,
                    std::span<const float> q, std::span<const float> k, std::span<const float> v, float sm_scale,
                    std::span<float> out, std::span<float> lse) {
  run_on_device(plan, tree, shape, dtype, q, k, v, sm_scale, out, lse, CudaRunOptions{});
}

void cuda_attention_per_request(const KvTree& tree, const AttnShape& shape, KvDType dtype, std::span<const float> q,
                                std::span<const float> k, std::span<const float> v, float sm_scale,
                                std::span<float> out, std::span<float> lse, const CudaRunOptions& options) {
  FT_CHECK(cuda_device_count() > 0, "cuda_attention_per_request: no CUDA device available");
  int dev = 0, sms = 0;
  FT_CUDA_CHECK(cudaGetDevice(&dev));
  FT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  PerRequestConfig cfg;
  cfg.num_sms = sms;
  Plan plan;
  build_per_request_plan(tree, shape, cfg, plan);
  run_on_device(plan, tree, shape, dtype, q, k, v, sm_scale, out, lse, options);
}

}  // namespace fasttree

