// Writer of safetensors files (the format read by engine/safetensors.h): used by tests to create
// checkpoints, and by tools. Tensors are laid out in name order, back to back; the JSON header is
// padded with spaces to a multiple of 8 bytes so that every tensor starts 8-byte aligned when the
// preceding tensors' sizes are multiples of 8.
#pragma once
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/npy.h"  // DType

namespace fasttree {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;     // stored dtype: fp32 values are rounded (nearest even) to F16 / BF16
  std::vector<int64_t> shape;
  std::span<const float> data;   // [numel] fp32 values, C order
};

// Writes `tensors` (and optional string metadata under "__metadata__") to `path`. Throws
// fasttree::Error naming the tensor on a duplicate or reserved name, a negative dimension, or a
// data size that does not match the shape; and naming the path when the file cannot be written.
void write_safetensors(const std::string& path, std::span<const SafetensorsTensor> tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace fasttree
