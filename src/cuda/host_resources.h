// Host-side helpers of the CUDA backend's entry points and timing harness (cuda/backend.cpp,
// cuda/timing.cpp): RAII holders of a device buffer, a non-blocking stream and the executable graph
// of one captured enqueue, and the kernel options both pass on. Runtime API only.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "cuda/cuda_check.h"
#include "cuda/tree_attention.h"

namespace fasttree::cuda_detail {

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

// Executable graph of whatever `enqueue` puts on `stream` (captured once).
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

// One launch: a replay of `graph` on `stream` when there is one, else enqueue() itself.
template <class F>
void replay_or_enqueue(const std::unique_ptr<Graph>& graph, cudaStream_t stream, F&& enqueue) {
  if (graph) {
    FT_CUDA_CHECK(cudaGraphLaunch(graph->exec, stream));
  } else {
    enqueue();
  }
}

// The kernel knobs that CudaRunOptions and CudaTimingOptions (cuda/backend.h) share, with the K/V
// pools' size in slots.
template <class O>
CudaTreeAttentionOptions shared_kernel_options(const O& o, int64_t kv_slots) {
  CudaTreeAttentionOptions opt;
  opt.atomic_scheduler = o.atomic_scheduler;
  opt.warp_unit_max_kv = o.warp_unit_max_kv;
  opt.warp_unit_min_units = o.warp_unit_min_units;
  opt.warp_overlap = o.warp_overlap;
  opt.warp_staged = o.warp_staged;
  opt.warp_stages = o.warp_stages;
  opt.warp_cta_warps = o.warp_cta_warps;
  opt.use_tma = o.use_tma;
  opt.deep_ring = o.deep_ring;
  opt.kv_slots = kv_slots;
  if (o.kv_head_major) opt.kv_layout = KvLayout::kHeadMajor;
  return opt;
}

}  // namespace fasttree::cuda_detail
