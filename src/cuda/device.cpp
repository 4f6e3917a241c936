#include "cuda/device.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <utility>

#include "core/error.h"
#include "cuda/cuda_check.h"

namespace fasttree {

namespace {

std::string mib(size_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

}  // namespace

// ---- DeviceBuffer -------------------------------------------------------------------------------

DeviceBuffer::DeviceBuffer(size_t bytes) { reserve(bytes); }

DeviceBuffer::~DeviceBuffer() { reset(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

bool DeviceBuffer::reserve(size_t bytes) {
  if (bytes <= bytes_) return false;
  reset();
  const cudaError_t err = cudaMalloc(&ptr_, bytes);
  if (err != cudaSuccess) {
    ptr_ = nullptr;
    (void)cudaGetLastError();  // clear the sticky-free allocation error
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    FT_FAIL("device allocation of " + std::to_string(bytes) + " bytes (" + mib(bytes) + ") failed: " +
            cudaGetErrorName(err) + " (" + mib(free_b) + " free of " + mib(total_b) + ")");
  }
  bytes_ = bytes;
  return true;
}

void DeviceBuffer::reset() {
  if (ptr_ != nullptr) (void)cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

// ---- PinnedBuffer -------------------------------------------------------------------------------

PinnedBuffer::PinnedBuffer(size_t bytes) { reserve(bytes); }

PinnedBuffer::~PinnedBuffer() { reset(); }

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

bool PinnedBuffer::reserve(size_t bytes) {
  if (bytes <= bytes_) return false;
  reset();
  const cudaError_t err = cudaMallocHost(&ptr_, bytes);
  if (err != cudaSuccess) {
    ptr_ = nullptr;
    (void)cudaGetLastError();
    FT_FAIL("pinned host allocation of " + std::to_string(bytes) + " bytes failed: " + cudaGetErrorName(err));
  }
  bytes_ = bytes;
  return true;
}

void PinnedBuffer::reset() {
  if (ptr_ != nullptr) (void)cudaFreeHost(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
}

// ---- streams and copies -------------------------------------------------------------------------

CudaStream::CudaStream() { FT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }

CudaStream::~CudaStream() {
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

void CudaStream::synchronize() const { FT_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void copy_to_device(void* dst, const void* src, size_t bytes, CUstream_st* stream) {
  if (bytes > 0) FT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
}

void copy_to_host(void* dst, const void* src, size_t bytes, CUstream_st* stream) {
  if (bytes > 0) FT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
}

void copy_on_device(void* dst, const void* src, size_t bytes, CUstream_st* stream) {
  if (bytes > 0) FT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
}

void copy_on_device_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                       CUstream_st* stream) {
  if (width > 0 && height > 0)
    FT_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDeviceToDevice, stream));
}

void memset_device(void* dst, int value, size_t bytes, CUstream_st* stream) {
  if (bytes > 0) FT_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream));
}

void memset_device_2d(void* dst, size_t pitch, int value, size_t width, size_t height, CUstream_st* stream) {
  if (width > 0 && height > 0) FT_CUDA_CHECK(cudaMemset2DAsync(dst, pitch, value, width, height, stream));
}

void synchronize(CUstream_st* stream) { FT_CUDA_CHECK(cudaStreamSynchronize(stream)); }

void check_last_error(const char* where) {
  const cudaError_t err = cudaGetLastError();
  FT_CHECK(err == cudaSuccess, std::string(where) + ": CUDA error " + cudaGetErrorName(err) + " (" +
                                   cudaGetErrorString(err) + ")");
}

DeviceMemInfo cuda_mem_info() {
  DeviceMemInfo info;
  FT_CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
  return info;
}

// ---- UploadStager -------------------------------------------------------------------------------

UploadStager::UploadStager(CUstream_st* stream, size_t chunk_bytes)
    : stream_(stream), chunk_bytes_(std::max<size_t>(chunk_bytes, 1)) {
  for (auto& e : done_) FT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

UploadStager::~UploadStager() {
  for (int i = 0; i < 2; ++i) {
    if (pending_[i]) (void)cudaEventSynchronize(done_[i]);  // the pinned buffer must outlive its copy
    if (done_[i] != nullptr) (void)cudaEventDestroy(done_[i]);
  }
}

void UploadStager::upload(void* dst, int64_t count, size_t elem_bytes, int64_t row, const Fill& fill) {
  FT_CHECK(count >= 0 && elem_bytes > 0 && row >= 1, "UploadStager: bad upload of " + std::to_string(count) +
                                                         " elements of " + std::to_string(elem_bytes) + " bytes");
  const int64_t rows_per_chunk = std::max<int64_t>(1, static_cast<int64_t>(chunk_bytes_ / (elem_bytes * row)));
  const int64_t chunk = rows_per_chunk * row;
  for (int64_t first = 0; first < count; first += chunk) {
    const int64_t n = std::min(chunk, count - first);
    const int b = next_;
    next_ ^= 1;
    if (pending_[b]) FT_CUDA_CHECK(cudaEventSynchronize(done_[b]));
    pending_[b] = false;
    buf_[b].reserve(static_cast<size_t>(chunk) * elem_bytes);
    fill(buf_[b].data(), first, n);
    FT_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + static_cast<size_t>(first) * elem_bytes, buf_[b].data(),
                                  static_cast<size_t>(n) * elem_bytes, cudaMemcpyHostToDevice, stream_));
    FT_CUDA_CHECK(cudaEventRecord(done_[b], stream_));
    pending_[b] = true;
  }
}

void UploadStager::finish() {
  for (int i = 0; i < 2; ++i) {
    if (pending_[i]) FT_CUDA_CHECK(cudaEventSynchronize(done_[i]));
    pending_[i] = false;
  }
}

// ---- PhaseTimer ---------------------------------------------------------------------------------

PhaseTimer::PhaseTimer(int num_phases) : num_phases_(num_phases) {
  FT_CHECK(num_phases > 0, "PhaseTimer: need at least one phase");
}

PhaseTimer::~PhaseTimer() {
  for (CUevent_st* e : events_) (void)cudaEventDestroy(e);
}

void PhaseTimer::record(CUstream_st* stream) {
  if (used_ == events_.size()) {
    cudaEvent_t e = nullptr;
    FT_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  FT_CUDA_CHECK(cudaEventRecord(events_[used_], stream));
  ++used_;
}

void PhaseTimer::begin(CUstream_st* stream) {
  used_ = 0;
  phase_.clear();
  record(stream);
}

void PhaseTimer::mark(int phase, CUstream_st* stream) {
  FT_CHECK(phase >= 0 && phase < num_phases_, "PhaseTimer: no phase " + std::to_string(phase));
  FT_CHECK(used_ > 0, "PhaseTimer: mark() before begin()");
  record(stream);
  phase_.push_back(phase);
}

void PhaseTimer::collect(std::span<double> ms) {
  FT_CHECK(ms.size() >= static_cast<size_t>(num_phases_), "PhaseTimer: collect() needs one slot per phase");
  for (size_t i = 1; i < used_; ++i) {
    float t = 0.0f;
    FT_CUDA_CHECK(cudaEventElapsedTime(&t, events_[i - 1], events_[i]));
    ms[static_cast<size_t>(phase_[i - 1])] += static_cast<double>(t);
  }
  used_ = 0;
  phase_.clear();
}

}  // namespace fasttree

namespace fasttree {

CudaGraph::~CudaGraph() { reset(); }

void CudaGraph::reset() {
  if (exec_ != nullptr) (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  exec_ = nullptr;
}

void CudaGraph::capture(CUstream_st* stream, const std::function<void()>& enqueue) {
  reset();
  FT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cudaGraph_t graph = nullptr;
  try {
    enqueue();
  } catch (...) {
    (void)cudaStreamEndCapture(stream, &graph);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    throw;
  }
  FT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  (void)cudaGraphDestroy(graph);
  FT_CUDA_CHECK(err);
  exec_ = exec;
}

void CudaGraph::launch(CUstream_st* stream) const {
  FT_CHECK(exec_ != nullptr, "CudaGraph::launch: nothing captured");
  FT_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), stream));
}

}  // namespace fasttree
