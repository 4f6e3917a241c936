// Timing harness of the CUDA backend (cuda/backend.h: cuda_time_plan, cuda_time_empty_launch):
// CUDA events around graph replays (or plain launches), the L2 put in a defined state before every
// timed run (L2Mode), median of the runs.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tree_gen.h"
#include "cuda/backend.h"
#include "cuda/cuda_check.h"
#include "cuda/host_resources.h"
#include "cuda/kernels.h"
#include "cuda/tree_attention.h"

namespace fasttree {

namespace {

using cuda_detail::DeviceBuffer;
using cuda_detail::Graph;
using cuda_detail::Stream;

constexpr size_t kFlushBytes = size_t{256} << 20;  // the flush buffer (5x the H200's 50 MB L2)
constexpr int kRotateL2Multiple = 4;  // kRotate: other copies' bytes read between two runs of one copy, in L2 sizes
constexpr int kMaxCopies = 256;       // kRotate: beyond this, the rest of the distance is a read flush
bool g_first_timing = true;           // the first timing warms the GPU up longer

int device_attr(cudaDeviceAttr attr) {
  int dev = 0, v = 0;
  FT_CUDA_CHECK(cudaGetDevice(&dev));
  FT_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, dev));
  return v;
}

// What runs before every timed run (untimed): a memset (kDirtyFlush) or a read (kCleanFlush) of
// `flush_bytes` of the scratch buffer, nothing for kWarm, and for kRotate the read flush of the
// distance the copies could not cover (flush_bytes, usually 0).
struct L2Prep {
  L2Mode mode;
  size_t flush_bytes;
  int grid;
  void operator()(const DeviceBuffer& scratch, int i, cudaStream_t s) const {
    if (mode == L2Mode::kWarm) return;
    if (mode == L2Mode::kDirtyFlush) {
      FT_CUDA_CHECK(cudaMemsetAsync(scratch.ptr, i & 0xff, flush_bytes, s));
      return;
    }
    // A read of whole 16-byte words; the last 16 bytes of the buffer are the (never written) sink.
    const int64_t bytes = static_cast<int64_t>(std::min(flush_bytes, kFlushBytes - 16)) & ~int64_t{15};
    if (bytes > 0)
      FT_CUDA_CHECK(cuda_detail::read_flush_launch(scratch.ptr, bytes, static_cast<char*>(scratch.ptr) + kFlushBytes - 16, grid, s));
  }
};

L2Prep make_prep(L2Mode mode, size_t rotate_shortfall) {
  const size_t bytes = mode == L2Mode::kRotate ? rotate_shortfall : mode == L2Mode::kWarm ? 0 : kFlushBytes;
  return L2Prep{mode, bytes, 4 * device_attr(cudaDevAttrMultiProcessorCount)};
}

// Median of CUDA-event timings of launch() (after `warmup` untimed runs), each preceded by prep();
// before them the GPU is kept busy so that its clocks are up. after_prep() runs after each prep,
// before the start event (untimed).
template <class F, class A = void (*)()>
CudaTiming time_launches(Stream& st, const DeviceBuffer& scratch, const L2Prep& prep, F&& launch,
                         const CudaTimingOptions& options, int warmup, A&& after_prep = [] {}) {
  {  // clocks up: flush-sized writes for a while (longer on the first call)
    const int ms = options.gpu_warmup_ms + (g_first_timing ? 300 : 0);
    g_first_timing = false;
    const auto t0 = std::chrono::steady_clock::now();
    while (ms > 0 && std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() < ms) {
      for (int i = 0; i < 8; ++i) FT_CUDA_CHECK(cudaMemsetAsync(scratch.ptr, i, kFlushBytes, st.s));
      FT_CUDA_CHECK(cudaStreamSynchronize(st.s));
    }
  }
  std::vector<cudaEvent_t> ev(2 * static_cast<size_t>(options.iters));
  for (cudaEvent_t& e : ev) FT_CUDA_CHECK(cudaEventCreate(&e));
  CudaTiming result;
  try {
    for (int i = 0; i < warmup; ++i) launch();
    // The GPU sleeps while the host enqueues every timed run, so that no run waits for the host
    // (kRotate and kWarm have no flush to hide the enqueue behind).
    FT_CUDA_CHECK(cuda_detail::delay_kernel_launch(1000000 + 50000 * static_cast<int64_t>(options.iters), st.s));
    for (int i = 0; i < options.iters; ++i) {
      prep(scratch, i, st.s);
      after_prep();
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

// One copy of a timed call's inputs and outputs with its own uploaded plan (and graph).
struct TimedCopy {
  DeviceBuffer q, k, v, out, lse;
  std::unique_ptr<CudaTreeAttention> att;
  std::unique_ptr<Graph> graph;

  TimedCopy(size_t q_bytes, size_t kv_bytes, size_t out_bytes, size_t lse_bytes)
      : q(q_bytes), k(kv_bytes), v(kv_bytes), out(out_bytes), lse(lse_bytes) {}
  void enqueue(cudaStream_t s) const { att->run(q.ptr, k.ptr, v.ptr, out.as<float>(), lse.as<float>(), s); }
  void launch(cudaStream_t s) const { cuda_detail::replay_or_enqueue(graph, s, [&] { enqueue(s); }); }
};

// kRotate: the number of copies that puts kRotateL2Multiple L2 capacities of other copies' bytes
// between two runs of one copy (at least 2, at most kMaxCopies; the shortfall, if the cap binds,
// is returned for a read flush). Fails when the copies do not fit in 80 % of the free memory.
int rotation_copies(size_t footprint, size_t& shortfall) {
  const size_t need = static_cast<size_t>(kRotateL2Multiple) * static_cast<size_t>(device_attr(cudaDevAttrL2CacheSize));
  footprint = std::max<size_t>(footprint, 1);
  size_t n = 1 + (need + footprint - 1) / footprint;
  n = std::clamp<size_t>(n, 2, kMaxCopies);
  shortfall = (n - 1) * footprint >= need ? 0 : need - (n - 1) * footprint;
  size_t free_bytes = 0, total = 0;
  FT_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
  FT_CHECK(static_cast<double>(n - 1) * static_cast<double>(footprint) <= 0.8 * static_cast<double>(free_bytes),
           "cuda_time_plan: " + std::to_string(n) + " rotated copies of " + std::to_string(footprint >> 20) +
               " MiB do not fit in the free device memory (" + std::to_string(free_bytes >> 20) +
               " MiB); time with L2Mode::kCleanFlush (--l2 clean) instead");
  return static_cast<int>(n);
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
  const int64_t q_elems = std::max<int64_t>(1, nq * hq * d), kv_elems = num_slots * hkv * d;
  const size_t q_bytes = static_cast<size_t>(q_elems) * 2, kv_bytes = static_cast<size_t>(kv_elems) * 2;
  const size_t out_bytes = static_cast<size_t>(q_elems) * 4, lse_bytes = static_cast<size_t>(std::max<int64_t>(1, nq * hq)) * 4;
  Stream st;
  DeviceBuffer scratch(kFlushBytes);
  CudaTreeAttentionOptions opt = cuda_detail::shared_kernel_options(options, num_slots);
  opt.run_merge = !options.skip_merge;
  const size_t trace_bytes = options.trace ? size_t{cuda_detail::kTraceKinds} * cuda_detail::kTraceCtas * cuda_detail::kTraceEvents * 8 : 0;
  DeviceBuffer trace(trace_bytes);
  opt.trace = trace.as<unsigned long long>();
  // Copies of the same inputs (same seeds: the same values at other addresses), each with its own
  // upload of the plan.
  std::vector<std::unique_ptr<TimedCopy>> copies;
  auto add_copy = [&] {
    auto c = std::make_unique<TimedCopy>(q_bytes, kv_bytes, out_bytes, lse_bytes);
    FT_CUDA_CHECK(cuda_detail::fill_uniform_launch(dt, c->q.ptr, q_elems, 1, st.s));
    FT_CUDA_CHECK(cuda_detail::fill_uniform_launch(dt, c->k.ptr, kv_elems, 2, st.s));
    FT_CUDA_CHECK(cuda_detail::fill_uniform_launch(dt, c->v.ptr, kv_elems, 3, st.s));
    c->att = std::make_unique<CudaTreeAttention>(shape, dtype, 0.0f, opt);
    c->att->upload(plan, tree, st.s, num_slots);
    if (options.use_graph) c->graph = std::make_unique<Graph>(st.s, [&, p = c.get()] { p->enqueue(st.s); });
    copies.push_back(std::move(c));
  };
  add_copy();
  size_t shortfall = 0;
  if (options.l2 == L2Mode::kRotate) {
    const size_t footprint = q_bytes + 2 * kv_bytes + out_bytes + lse_bytes + copies[0]->att->plan_bytes().second;
    const int n = rotation_copies(footprint, shortfall);
    while (static_cast<int>(copies.size()) < n) add_copy();
  }
  const L2Prep prep = make_prep(options.l2, shortfall);
  size_t next = 0;  // the copy the next launch runs
  auto launch = [&] {
    copies[next]->launch(st.s);
    next = (next + 1) % copies.size();
  };
  // Diagnostics (FT_TIMING_WARM, bits): 1 = the plan arena, 2 = Q of the copy about to run read back
  // into L2 after each prep (untimed), i.e. what the kernel's start would cost were they L2-resident
  // as in an engine step right after the plan's upload and Q's projection.
  const char* warm_env = std::getenv("FT_TIMING_WARM");
  const int warm = warm_env != nullptr ? std::atoi(warm_env) : 0;
  const size_t plan_cap = copies[0]->att->plan_bytes().second;
  DeviceBuffer warm_scratch(warm != 0 ? plan_cap + q_bytes : 0);
  auto after_prep = [&] {
    const TimedCopy& c = *copies[next];
    const auto [plan_ptr, plan_len] = c.att->plan_bytes();
    if ((warm & 1) && plan_len > 0)
      FT_CUDA_CHECK(cudaMemcpyAsync(warm_scratch.ptr, plan_ptr, std::min(plan_len, plan_cap), cudaMemcpyDeviceToDevice, st.s));
    if (warm & 2)
      FT_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(warm_scratch.ptr) + plan_cap, c.q.ptr, q_bytes,
                                    cudaMemcpyDeviceToDevice, st.s));
  };
  // Every copy launched at least once untimed (a graph's first launch uploads it).
  const int warmup = std::max<int>(options.warmup, static_cast<int>(copies.size()));
  CudaTiming result = time_launches(st, scratch, prep, launch, options, warmup, after_prep);
  result.copies = static_cast<int>(copies.size());
  if (options.trace) {  // one more run, from cleared marks and the same L2 state
    FT_CUDA_CHECK(cudaMemsetAsync(trace.ptr, 0, trace_bytes, st.s));
    prep(scratch, 0, st.s);
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
  DeviceBuffer scratch(kFlushBytes);
  auto enqueue = [&] { FT_CUDA_CHECK(cuda_detail::empty_kernel_launch(grid, st.s)); };
  std::unique_ptr<Graph> graph;
  if (options.use_graph) graph = std::make_unique<Graph>(st.s, enqueue);
  auto launch = [&] { cuda_detail::replay_or_enqueue(graph, st.s, enqueue); };
  CudaTiming result = time_launches(st, scratch, make_prep(options.l2, 0), launch, options, options.warmup);
  result.copies = 1;
  return result;
}

}  // namespace fasttree
