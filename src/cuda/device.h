// Device memory, streams, copies and event timing for the engine (engine/gpu_model.h), with no
// CUDA header: streams are CUstream_st* (= cudaStream_t), events CUevent_st* (= cudaEvent_t).
// Every failing CUDA call throws fasttree::Error naming the call and the CUDA error.
//
//   DeviceBuffer    cudaMalloc'd bytes (RAII, movable); a failed allocation names the bytes asked
//                   for and the device's free memory. reserve() grows (contents lost), never shrinks.
//   PinnedBuffer    cudaMallocHost'd bytes (page-locked host memory for asynchronous copies).
//   CudaStream      a non-blocking stream.
//   copy_*          cudaMemcpyAsync on a stream (a pageable host side makes the copy synchronous
//                   with respect to the host, as CUDA defines).
//   UploadStager    host -> device uploads of data produced on the host chunk by chunk (weights:
//                   conversion to bf16 overlaps the copy of the previous chunk; two pinned buffers).
//   PhaseTimer      CUDA events recorded between the phases of a step; after the step's final
//                   stream synchronization, collect() adds each phase's elapsed time.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

struct CUstream_st;
struct CUevent_st;

namespace fasttree {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  template <class T>
  size_t count() const {
    return bytes_ / sizeof(T);
  }
  // Ensures at least `bytes` (the old contents are dropped when it grows). True when it reallocated.
  bool reserve(size_t bytes);
  void reset();  // frees

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  bool reserve(size_t bytes);  // as DeviceBuffer::reserve
  void reset();

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class CudaStream {
 public:
  CudaStream();  // cudaStreamCreateWithFlags(cudaStreamNonBlocking)
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  CUstream_st* get() const { return stream_; }
  void synchronize() const;

 private:
  CUstream_st* stream_ = nullptr;
};

// A CUDA graph captured from the work a callable enqueues on a stream, replayed with launch().
// Capture uses cudaStreamCaptureModeThreadLocal (other threads may keep using CUDA); a failed
// capture leaves the graph empty and throws. Replays need the captured pointers to stay valid.
class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  void capture(CUstream_st* stream, const std::function<void()>& enqueue);
  void launch(CUstream_st* stream) const;
  bool valid() const { return exec_ != nullptr; }
  void reset();

 private:
  void* exec_ = nullptr;  // cudaGraphExec_t
};

void copy_to_device(void* dst, const void* src, size_t bytes, CUstream_st* stream);
void copy_to_host(void* dst, const void* src, size_t bytes, CUstream_st* stream);
void copy_on_device(void* dst, const void* src, size_t bytes, CUstream_st* stream);
// `height` rows of `width` bytes, from rows `src_pitch` bytes apart to rows `dst_pitch` apart (cudaMemcpy2DAsync).
void copy_on_device_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                       CUstream_st* stream);
void memset_device(void* dst, int value, size_t bytes, CUstream_st* stream);
// `height` rows of `width` bytes each, rows `pitch` bytes apart (cudaMemset2DAsync).
void memset_device_2d(void* dst, size_t pitch, int value, size_t width, size_t height, CUstream_st* stream);
void synchronize(CUstream_st* stream);
// Throws when a previous asynchronous kernel failed (cudaGetLastError), naming `where`.
void check_last_error(const char* where);

struct DeviceMemInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};
DeviceMemInfo cuda_mem_info();  // of the current device

class UploadStager {
 public:
  // fill(host, first, count): write elements [first, first + count) of the upload into `host`.
  using Fill = std::function<void(void* host, int64_t first, int64_t count)>;

  UploadStager(CUstream_st* stream, size_t chunk_bytes = size_t{32} << 20);
  ~UploadStager();
  UploadStager(const UploadStager&) = delete;
  UploadStager& operator=(const UploadStager&) = delete;

  // Uploads `count` elements of `elem_bytes` bytes each to device `dst`, produced by `fill` in chunks
  // of whole `row` elements (row >= 1; a chunk holds at least one row even when bigger than
  // chunk_bytes). Returns once the last chunk's copy is enqueued.
  void upload(void* dst, int64_t count, size_t elem_bytes, int64_t row, const Fill& fill);
  void finish();  // waits for every enqueued copy

 private:
  CUstream_st* stream_;
  size_t chunk_bytes_;
  PinnedBuffer buf_[2];
  CUevent_st* done_[2] = {nullptr, nullptr};
  bool pending_[2] = {false, false};
  int next_ = 0;
};

class PhaseTimer {
 public:
  explicit PhaseTimer(int num_phases);
  ~PhaseTimer();
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  // Starts a step: records the first event on `stream` (drops marks of an uncollected step).
  void begin(CUstream_st* stream);
  // Records an event; the time since the previous event counts for `phase`.
  void mark(int phase, CUstream_st* stream);
  // After the stream was synchronized: adds each phase's elapsed ms to ms[phase] and clears the step.
  void collect(std::span<double> ms);

 private:
  int num_phases_;
  std::vector<CUevent_st*> events_;  // created on first use, reused every step
  std::vector<int> phase_;           // phase of mark i (event i + 1)
  size_t used_ = 0;                  // events recorded this step
  void record(CUstream_st* stream);
};

}  // namespace fasttree
