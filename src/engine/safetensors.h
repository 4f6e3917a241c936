// Reader of safetensors checkpoints (HF format), memory-mapped, strictly validated.
//
// File layout: [u64 little-endian N][N bytes of JSON header][data buffer]. The header is an object
//   { "<tensor name>": {"dtype": "BF16"|"F16"|"F32", "shape": [d0, d1, ...], "data_offsets": [b, e]},
//     "__metadata__": {...} (ignored) }
// where [b, e) is the tensor's byte range inside the data buffer (C order, little endian).
// Accepted dtypes: BF16, F16, F32; any other dtype is rejected naming the tensor. Validation on open:
// header length within the file, valid JSON object, no duplicate tensor names, every field present
// and well typed, e - b == numel * dtype size, ranges inside the data buffer and not overlapping
// (holes are allowed). Every error is one line naming the file (and the tensor when there is one).
//
// A SafetensorsFolder opens a checkpoint folder: the shards listed in model.safetensors.index.json
// when it exists (every weight_map entry must be in its shard), otherwise every *.safetensors file
// in it (sorted by name); a path to a single *.safetensors file also works. Tensor names must be
// unique across shards. Views stay valid while the folder lives.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/npy.h"  // DType
#include "engine/mapped_file.h"

namespace fasttree {

// Bytes per element of a dtype (4 for F32, 2 for F16 / BF16).
size_t dtype_size(DType dtype);
// The safetensors spelling: "F32", "F16", "BF16".
const char* safetensors_dtype_name(DType dtype);

// One tensor inside a mapped file. `data` points into the mapping and may be unaligned.
struct TensorView {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;

  int64_t numel() const;  // product of shape (1 for a scalar)
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
};

// Converts n elements of `dtype` at `src` (any alignment) to fp32 (exact for every input).
void convert_to_f32(DType dtype, const void* src, int64_t n, float* dst);

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return file_.path(); }
  const std::vector<std::string>& names() const { return names_; }  // sorted
  const TensorView* find(std::string_view name) const;              // nullptr when absent
  const TensorView& tensor(std::string_view name) const;            // throws naming file and tensor

 private:
  MappedFile file_;
  std::map<std::string, TensorView, std::less<>> tensors_;
  std::vector<std::string> names_;
};

class SafetensorsFolder {
 public:
  explicit SafetensorsFolder(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> files() const;  // the shards opened, in open order
  std::vector<std::string> names() const;  // every tensor, sorted
  const TensorView* find(std::string_view name) const;  // nullptr when absent
  // Throws "<folder>: tensor '<name>' not found (N tensors in K files)" when absent.
  const TensorView& tensor(std::string_view name) const;
  const std::string& file_of(std::string_view name) const;  // shard holding the tensor (throws when absent)

  // Checks the tensor's shape against `expected` (error naming the file, the tensor, the expected
  // and the actual shape) and converts it to fp32 into `out` (numel floats) / a new vector.
  void read_f32(std::string_view name, std::span<const int64_t> expected, std::span<float> out) const;
  std::vector<float> to_f32(std::string_view name, std::span<const int64_t> expected) const;

 private:
  struct Entry {
    int file;
    const TensorView* view;
  };
  void add_file(const std::string& file_path);
  const Entry& entry(std::string_view name) const;
  const TensorView& checked(std::string_view name, std::span<const int64_t> expected) const;

  std::string path_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry, std::less<>> index_;
};

}  // namespace fasttree
