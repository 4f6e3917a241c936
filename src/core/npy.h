// NumPy .npy tensors on the host (DESIGN.md §5): Q [num_queries, Hq, d], K/V [num_slots, Hkv, d],
// output [num_queries, Hq, d].
//   read_npy  accepts little-endian '<f4' and '<f2' (converted to float), C order, format versions
//             1.0 / 2.0 / 3.0; anything else is rejected with a one-line message naming the path.
//   write_npy writes version 1.0 (2.0 if the header needs it), '<f4' or '<f2' (round to nearest even).
// HostTensor data is always fp32, row-major; a shape of [] is a scalar (numel 1).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace fasttree {

// Element type of a tensor file or device buffer. kBF16 is not an npy type (only callers use it).
enum class DType { kF32, kF16, kBF16 };

const char* dtype_name(DType dtype);  // "f32", "f16", "bf16"

struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // [numel], C order

  int64_t numel() const;  // product of shape (1 for a scalar)
};

HostTensor read_npy(const std::string& path);
void write_npy(const std::string& path, const HostTensor& t, DType dtype = DType::kF32);

// "[4, 32, 128]"; with wildcard, a dim of -1 prints as "*".
std::string shape_str(std::span<const int64_t> shape, bool wildcard = false);

// Throws "<what>: expected shape [4, 32, 128], got [4, 32, 64]" unless the ranks agree and every
// dim matches; an expected dim of -1 matches anything.
void check_shape(const HostTensor& t, std::span<const int64_t> expected, const std::string& what);

}  // namespace fasttree
