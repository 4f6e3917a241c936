// Host-side RAII holders of the CUDA backend's entry points and timing harness (cuda/backend.cpp,
// cuda/timing.cpp): a device buffer, a non-blocking stream, and the executable graph of one
// captured enqueue. Runtime API only.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/cuda_check.h"

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

}  // namespace fasttree::cuda_detail
