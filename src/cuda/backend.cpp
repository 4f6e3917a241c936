// CUDA backend entry points on host arrays (runtime API only; never links libcuda directly).
#include "cuda/backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/tree_gen.h"
#include "cuda/cuda_check.h"
#include "cuda/kernels.h"
#include "plan/per_request_plan.h"
#include "cuda/tree_attention.h"

namespace fasttree {

namespace {

std::string str(int64_t x) { return std::to_string(x); }

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (bytes > 0) FT_CUDA_CHECK(cudaMalloc(&ptr, bytes));
  }
  ~DeviceBuffer() {
    if (ptr != nullptr) (void)cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { FT_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~Stream() { (void)cudaStreamDestroy(s); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

// Executable graph of one att.run(...) captured on `stream`.
struct Graph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  template <class F>
  Graph(cudaStream_t stream, F&& enqueue) {
    FT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue();
    } catch (...) {
      cudaGraph_t g = nullptr;
      (void)cudaStreamEndCapture(stream, &g);
      if (g != nullptr) (void)cudaGraphDestroy(g);
      throw;
    }
    FT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    FT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  }
  ~Graph() {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
};

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
  CudaTreeAttentionOptions opt;
  opt.atomic_scheduler = options.atomic_scheduler;
  opt.warp_unit_max_kv = options.warp_unit_max_kv;
  opt.warp_unit_min_units = options.warp_unit_min_units;
  opt.warp_overlap = options.warp_overlap;
  opt.warp_staged = options.warp_staged;
  opt.warp_stages = options.warp_stages;
  opt.warp_cta_warps = options.warp_cta_warps;
  opt.merge_wide = options.merge_wide;
  opt.use_tma = options.use_tma;
  opt.use_tma_q = options.use_tma_q;
  opt.deep_ring = options.deep_ring;
  opt.fit_grid = options.fit_grid;
  opt.kv_slots = num_slots;
  if (options.kv_head_major) opt.kv_layout = KvLayout::kHeadMajor;
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

namespace {

// One timed launch: a replay of the graph captured from `enqueue` (use_graph), else enqueue itself.
template <class F>
class Launcher {
 public:
  Launcher(cudaStream_t stream, F& enqueue, bool use_graph) : stream_(stream), enqueue_(enqueue) {
    if (use_graph) graph_ = std::make_unique<Graph>(stream, enqueue);
  }
  void operator()() const {
    if (graph_) {
      FT_CUDA_CHECK(cudaGraphLaunch(graph_->exec, stream_));
    } else {
      enqueue_();
    }
  }

 private:
  cudaStream_t stream_;
  F& enqueue_;
  std::unique_ptr<Graph> graph_;
};

constexpr size_t kFlushBytes = size_t{256} << 20;  // L2 flush buffer of the timings
bool g_first_timing = true;                          // the first timing warms the GPU up longer

// Median of CUDA-event timings of launch() (after options.warmup untimed runs), each preceded by
// an L2 flush when options.flush_l2; before them the GPU is kept busy so that its clocks are up.
// after_flush() runs after each flush, before the start event (untimed).
template <class F, class A = void (*)()>
CudaTiming time_launches(Stream& st, DeviceBuffer& flush, F&& launch, const CudaTimingOptions& options,
                         A&& after_flush = [] {}) {
  // Clocks up: keep the GPU busy with flush-sized writes for a while (longer on the first call).
  {
    const int ms = options.gpu_warmup_ms + (g_first_timing ? 300 : 0);
    g_first_timing = false;
    if (ms > 0 && flush.ptr != nullptr) {
      const auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() < ms) {
        for (int i = 0; i < 8; ++i) FT_CUDA_CHECK(cudaMemsetAsync(flush.ptr, i, kFlushBytes, st.s));
        FT_CUDA_CHECK(cudaStreamSynchronize(st.s));
      }
    }
  }
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(options.iters));
  for (cudaEvent_t& e : ev) FT_CUDA_CHECK(cudaEventCreate(&e));
  CudaTiming result;
  try {
    for (int i = 0; i < options.warmup; ++i) launch();
    for (int i = 0; i < options.iters; ++i) {
      if (options.flush_l2) FT_CUDA_CHECK(cudaMemsetAsync(flush.ptr, i & 0xff, kFlushBytes, st.s));
      after_flush();
      FT_CUDA_CHECK(cudaEventRecord(ev[2 * i], st.s));
      launch();
      FT_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], st.s));
    }
    FT_CUDA_CHECK(cudaStreamSynchronize(st.s));
    FT_CUDA_CHECK(cudaGetLastError());
    std::vector<double> us(options.iters);
    for (int i = 0; i < options.iters; ++i) {
      float ms = 0;
      FT_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
      us[i] = 1000.0 * ms;
    }
    std::sort(us.begin(), us.end());
    result.median_us = us[us.size() / 2];
    result.min_us = us.front();
    result.runs = options.iters;
  } catch (...) {
    for (cudaEvent_t e : ev) (void)cudaEventDestroy(e);
    throw;
  }
  for (cudaEvent_t e : ev) (void)cudaEventDestroy(e);
  return result;
}

}  // namespace

CudaTiming cuda_time_plan(const Plan& plan, const KvTree& tree, const AttnShape& shape, KvDType dtype,
                          const CudaTimingOptions& options) {
  FT_CHECK(cuda_device_count() > 0, "cuda_time_plan: no CUDA device available");
  FT_CHECK(options.iters >= 1 && options.warmup >= 0, "cuda_time_plan: iters must be >= 1");
  shape.validate();
  const int64_t nq = tree.num_queries(), hq = shape.num_qo_heads, hkv = shape.num_kv_heads, d = shape.head_dim;
  const int64_t num_slots = std::max<int64_t>(1, max_slot_plus_one(tree));
  const int dt = dtype == KvDType::kF16 ? cuda_detail::kDTypeF16 : cuda_detail::kDTypeBF16;
  Stream st;
  DeviceBuffer dq(static_cast<size_t>(std::max<int64_t>(1, nq * hq * d)) * 2);
  DeviceBuffer dk(static_cast<size_t>(num_slots * hkv * d) * 2), dv(static_cast<size_t>(num_slots * hkv * d) * 2);
  DeviceBuffer dout(static_cast<size_t>(std::max<int64_t>(1, nq * hq * d)) * 4), dlse(static_cast<size_t>(std::max<int64_t>(1, nq * hq)) * 4);
  DeviceBuffer flush(options.flush_l2 ? kFlushBytes : 0);
  FT_CUDA_CHECK(cuda_detail::fill_uniform_launch(dt, dq.ptr, nq * hq * d, 1, st.s));
  FT_CUDA_CHECK(cuda_detail::fill_uniform_launch(dt, dk.ptr, num_slots * hkv * d, 2, st.s));
  FT_CUDA_CHECK(cuda_detail::fill_uniform_launch(dt, dv.ptr, num_slots * hkv * d, 3, st.s));
  CudaTreeAttentionOptions opt;
  opt.atomic_scheduler = options.atomic_scheduler;
  opt.warp_unit_max_kv = options.warp_unit_max_kv;
  opt.warp_unit_min_units = options.warp_unit_min_units;
  opt.warp_overlap = options.warp_overlap;
  opt.warp_staged = options.warp_staged;
  opt.warp_stages = options.warp_stages;
  opt.warp_cta_warps = options.warp_cta_warps;
  opt.run_merge = !options.skip_merge;
  opt.use_tma = options.use_tma;
  opt.deep_ring = options.deep_ring;
  opt.kv_slots = num_slots;
  if (options.kv_head_major) opt.kv_layout = KvLayout::kHeadMajor;
  const size_t trace_bytes = options.trace ? size_t{cuda_detail::kTraceKinds} * cuda_detail::kTraceCtas * cuda_detail::kTraceEvents * 8 : 0;
  DeviceBuffer trace(trace_bytes);
  opt.trace = trace.as<unsigned long long>();
  CudaTreeAttention att(shape, dtype, 0.0f, opt);
  att.upload(plan, tree, st.s, num_slots);
  auto enqueue = [&] { att.run(dq.ptr, dk.ptr, dv.ptr, dout.as<float>(), dlse.as<float>(), st.s); };
  Launcher<decltype(enqueue)> launch(st.s, enqueue, options.use_graph);
  // Diagnostics (FT_TIMING_WARM, bits): 1 = the plan arena, 2 = Q read back into L2 after each
  // flush (untimed), i.e. what the kernel's start would cost were they L2-resident as in an engine
  // step right after the plan's upload and Q's projection.
  const char* warm_env = std::getenv("FT_TIMING_WARM");
  const int warm = warm_env != nullptr ? std::atoi(warm_env) : 0;
  const auto [plan_ptr, plan_len] = att.plan_bytes();
  const size_t q_bytes = static_cast<size_t>(std::max<int64_t>(1, nq * hq * d)) * 2;
  DeviceBuffer warm_scratch(warm != 0 ? plan_len + q_bytes : 0);
  auto after_flush = [&] {
    if ((warm & 1) && plan_len > 0)
      FT_CUDA_CHECK(cudaMemcpyAsync(warm_scratch.ptr, plan_ptr, plan_len, cudaMemcpyDeviceToDevice, st.s));
    if (warm & 2)
      FT_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(warm_scratch.ptr) + plan_len, dq.ptr, q_bytes,
                                    cudaMemcpyDeviceToDevice, st.s));
  };
  CudaTiming result = time_launches(st, flush, launch, options, after_flush);
  if (options.trace) {  // one more run, from cleared marks and a flushed L2
    FT_CUDA_CHECK(cudaMemsetAsync(trace.ptr, 0, trace_bytes, st.s));
    if (options.flush_l2) FT_CUDA_CHECK(cudaMemsetAsync(flush.ptr, 0x5a, kFlushBytes, st.s));
    launch();
    result.trace.resize(trace_bytes / 8);
    FT_CUDA_CHECK(cudaMemcpyAsync(result.trace.data(), trace.ptr, trace_bytes, cudaMemcpyDeviceToHost, st.s));
    FT_CUDA_CHECK(cudaStreamSynchronize(st.s));
  }
  return result;
}

bool cuda_trace_built() { return FT_TRACE != 0; }

CudaTiming cuda_time_empty_launch(int grid, const CudaTimingOptions& options) {
  FT_CHECK(cuda_device_count() > 0, "cuda_time_empty_launch: no CUDA device available");
  FT_CHECK(grid >= 1 && options.iters >= 1 && options.warmup >= 0, "cuda_time_empty_launch: grid and iters must be >= 1");
  Stream st;
  DeviceBuffer flush(options.flush_l2 ? kFlushBytes : 0);
  auto enqueue = [&] { FT_CUDA_CHECK(cuda_detail::empty_kernel_launch(grid, st.s)); };
  Launcher<decltype(enqueue)> launch(st.s, enqueue, options.use_graph);
  return time_launches(st, flush, launch, options);
}

}  // namespace fasttree

