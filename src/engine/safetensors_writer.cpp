#include "engine/safetensors_writer.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/half.h"
#include "engine/safetensors.h"

namespace fasttree {

void write_safetensors(const std::string& path, std::span<const SafetensorsTensor> tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<const SafetensorsTensor*> order;
  std::set<std::string> names;
  for (const SafetensorsTensor& t : tensors) {
    FT_CHECK(!t.name.empty() && t.name != "__metadata__",
             path + ": invalid tensor name '" + t.name + "'");
    FT_CHECK(names.insert(t.name).second, path + ": tensor '" + t.name + "' given twice");
    int64_t numel = 1;
    for (int64_t d : t.shape) {
      FT_CHECK(d >= 0, path + ": tensor '" + t.name + "' has negative dimension in shape " + shape_str(t.shape));
      numel *= d;
    }
    FT_CHECK(t.data.size() == static_cast<size_t>(numel),
             path + ": tensor '" + t.name + "' has " + std::to_string(t.data.size()) + " values for shape " +
                 shape_str(t.shape));
    order.push_back(&t);
  }
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->name < b->name; });

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const SafetensorsTensor* t : order) {
    const int64_t bytes = static_cast<int64_t>(t->data.size() * dtype_size(t->dtype));
    header[t->name] = {{"dtype", safetensors_dtype_name(t->dtype)},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  FT_CHECK(f.good(), path + ": cannot open for writing");
  const uint64_t len = text.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
  std::vector<uint16_t> half;
  for (const SafetensorsTensor* t : order) {
    if (t->dtype == DType::kF32) {
      f.write(reinterpret_cast<const char*>(t->data.data()), static_cast<std::streamsize>(t->data.size() * 4));
      continue;
    }
    half.resize(t->data.size());
    for (size_t i = 0; i < half.size(); ++i)
      half[i] = t->dtype == DType::kF16 ? float_to_half(t->data[i]) : float_to_bf16(t->data[i]);
    f.write(reinterpret_cast<const char*>(half.data()), static_cast<std::streamsize>(half.size() * 2));
  }
  f.close();
  FT_CHECK(!f.fail(), path + ": write failed");
}

}  // namespace fasttree
