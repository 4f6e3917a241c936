#include "engine/safetensors.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/half.h"

namespace fasttree {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr uint64_t kMaxHeaderLen = 100'000'000;      // the reference implementation's limit
constexpr int64_t kMaxNumel = int64_t{1} << 48;      // anything larger is a corrupt header
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::string qname(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('\'');
  out.append(s);
  out.push_back('\'');
  return out;
}

// dtype spellings of the format; only the first three are supported.
bool parse_dtype(const std::string& s, DType& out) {
  if (s == "F32") out = DType::kF32;
  else if (s == "F16") out = DType::kF16;
  else if (s == "BF16") out = DType::kBF16;
  else return false;
  return true;
}
bool is_known_dtype(const std::string& s) {
  static const std::set<std::string> known = {"BOOL", "U8",  "I8",  "U16", "I16",     "U32",     "I32",
                                              "U64",  "I64", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4",
                                              "F6_E2M3", "F6_E3M2", "C64"};
  return known.count(s) != 0;
}

int64_t json_uint(const json& v, const std::string& where) {
  FT_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0),
           where + " must be a non-negative integer, got " + v.dump());
  const uint64_t u = v.get<uint64_t>();
  FT_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), where + " is too large: " + v.dump());
  return static_cast<int64_t>(u);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  FT_CHECK(f.good(), path + ": cannot open");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

size_t dtype_size(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
  }
  return "?";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

void convert_to_f32(DType dtype, const void* src, int64_t n, float* dst) {
  const auto* p = static_cast<const unsigned char*>(src);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, p, static_cast<size_t>(n) * 4);
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = half_to_float(h);
      }
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = bf16_to_float(h);
      }
      return;
  }
}

// ---- SafetensorsFile ----------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  const size_t size = file_.size();
  FT_CHECK(size >= 8, path + ": not a safetensors file (" + std::to_string(size) +
                          " bytes, shorter than the 8-byte header length)");
  uint64_t header_len = 0;
  std::memcpy(&header_len, file_.data(), 8);
  FT_CHECK(header_len <= size - 8, path + ": header length " + std::to_string(header_len) +
                                       " exceeds the file (" + std::to_string(size) + " bytes)");
  FT_CHECK(header_len <= kMaxHeaderLen, path + ": header length " + std::to_string(header_len) +
                                            " exceeds the limit of " + std::to_string(kMaxHeaderLen) + " bytes");
  const char* header_begin = reinterpret_cast<const char*>(file_.data()) + 8;
  const std::string_view header(header_begin, static_cast<size_t>(header_len));
  const unsigned char* buffer = file_.data() + 8 + header_len;
  const int64_t buffer_len = static_cast<int64_t>(size - 8 - header_len);

  // Parse, catching duplicate top-level keys (nlohmann keeps the last one silently).
  std::string duplicate;
  std::set<std::string> seen;
  json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) {
      const std::string key = parsed.get<std::string>();
      if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
    }
    return true;
  };
  json doc;
  try {
    doc = json::parse(header.begin(), header.end(), on_event);
  } catch (const json::exception& e) {
    FT_FAIL(path + ": header is not valid JSON (" + e.what() + ")");
  }
  FT_CHECK(duplicate.empty(), path + ": tensor " + qname(duplicate) + " appears twice in the header");
  FT_CHECK(doc.is_object(), path + ": header is not a JSON object");

  struct Range {
    int64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") continue;
    const std::string where = path + ": tensor " + qname(name);
    const json& info = it.value();
    FT_CHECK(info.is_object(), where + ": entry is not an object");
    for (const char* field : {"dtype", "shape", "data_offsets"})
      FT_CHECK(info.contains(field), where + ": missing field '" + field + "'");
    const json& jd = info["dtype"];
    FT_CHECK(jd.is_string(), where + ": 'dtype' is not a string");
    const std::string dtype_str = jd.get<std::string>();
    TensorView view;
    if (!parse_dtype(dtype_str, view.dtype)) {
      FT_FAIL(where + (is_known_dtype(dtype_str) ? ": dtype " + dtype_str + " is not supported"
                                                 : ": unknown dtype " + qname(dtype_str)) +
              " (supported: BF16, F16, F32)");
    }
    const json& js = info["shape"];
    FT_CHECK(js.is_array(), where + ": 'shape' is not an array");
    int64_t numel = 1;
    for (size_t i = 0; i < js.size(); ++i) {
      const int64_t d = json_uint(js[i], where + ": shape[" + std::to_string(i) + "]");
      FT_CHECK(d == 0 || numel <= kMaxNumel / d, where + ": shape " + js.dump() + " is absurdly large");
      numel *= d;
      view.shape.push_back(d);
    }
    const json& jo = info["data_offsets"];
    FT_CHECK(jo.is_array() && jo.size() == 2, where + ": 'data_offsets' is not an array [begin, end]");
    const int64_t begin = json_uint(jo[0], where + ": data_offsets[0]");
    const int64_t end = json_uint(jo[1], where + ": data_offsets[1]");
    FT_CHECK(begin <= end, where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                               "] end before begin");
    const int64_t expected = numel * static_cast<int64_t>(dtype_size(view.dtype));
    FT_CHECK(end - begin == expected, where + ": data_offsets [" + std::to_string(begin) + ", " +
                                          std::to_string(end) + "] hold " + std::to_string(end - begin) +
                                          " bytes but shape " + shape_str(view.shape) + " " + dtype_str +
                                          " needs " + std::to_string(expected));
    FT_CHECK(end <= buffer_len, where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                                    "] out of bounds of the " + std::to_string(buffer_len) + "-byte data buffer");
    view.data = buffer + begin;
    auto [pos, inserted] = tensors_.emplace(name, std::move(view));
    (void)inserted;
    ranges.push_back({begin, end, &pos->first});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  const Range* prev = nullptr;
  for (const Range& r : ranges) {
    if (r.begin == r.end) continue;  // empty tensors occupy no bytes
    if (prev != nullptr)
      FT_CHECK(r.begin >= prev->end, path + ": tensors " + qname(*prev->name) + " and " + qname(*r.name) +
                                         " overlap in the data buffer");
    prev = &r;
  }
  names_.reserve(tensors_.size());
  for (const auto& [name, view] : tensors_) names_.push_back(name);
}

const TensorView* SafetensorsFile::find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const TensorView& SafetensorsFile::tensor(std::string_view name) const {
  const TensorView* v = find(name);
  FT_CHECK(v != nullptr, path() + ": tensor " + qname(name) + " not found");
  return *v;
}

// ---- SafetensorsFolder --------------------------------------------------------------------------

SafetensorsFolder::SafetensorsFolder(const std::string& path) : path_(path) {
  std::error_code ec;
  const fs::path root(path);
  if (fs::is_regular_file(root, ec)) {
    add_file(path);
    return;
  }
  FT_CHECK(fs::is_directory(root, ec), path + ": no such checkpoint folder or safetensors file");
  const fs::path index_path = root / kIndexFile;
  if (fs::exists(index_path, ec)) {
    const std::string ip = index_path.string();
    json index;
    try {
      index = json::parse(read_text(ip));
    } catch (const json::exception& e) {
      FT_FAIL(ip + ": not valid JSON (" + e.what() + ")");
    }
    FT_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
             ip + ": missing object 'weight_map'");
    std::vector<std::string> shards;
    std::set<std::string> seen;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      FT_CHECK(it.value().is_string(), ip + ": weight_map entry " + qname(it.key()) + " is not a file name");
      const std::string shard = it.value().get<std::string>();
      FT_CHECK(!shard.empty() && fs::path(shard).filename().string() == shard,
               ip + ": weight_map entry " + qname(it.key()) + " names " + qname(shard) +
                   ", not a file name inside the folder");
      if (seen.insert(shard).second) shards.push_back(shard);
    }
    std::sort(shards.begin(), shards.end());
    FT_CHECK(!shards.empty(), ip + ": weight_map is empty");
    for (const std::string& shard : shards) add_file((root / shard).string());
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      const std::string shard_path = (root / it.value().get<std::string>()).string();
      auto e = index_.find(it.key());
      FT_CHECK(e != index_.end() && files_[e->second.file]->path() == shard_path,
               ip + ": tensor " + qname(it.key()) + " is listed in " + shard_path + " but not stored there");
    }
    return;
  }
  std::vector<std::string> found;
  for (const auto& de : fs::directory_iterator(root, ec)) {
    if (de.path().extension() == ".safetensors" && de.is_regular_file()) found.push_back(de.path().string());
  }
  FT_CHECK(!ec, path + ": cannot list folder (" + ec.message() + ")");
  FT_CHECK(!found.empty(), path + ": no *.safetensors files (and no " + kIndexFile + ")");
  std::sort(found.begin(), found.end());
  for (const std::string& f : found) add_file(f);
}

void SafetensorsFolder::add_file(const std::string& file_path) {
  files_.push_back(std::make_unique<SafetensorsFile>(file_path));
  const int fi = static_cast<int>(files_.size()) - 1;
  const SafetensorsFile& f = *files_.back();
  for (const std::string& name : f.names()) {
    auto [it, inserted] = index_.emplace(name, Entry{fi, f.find(name)});
    FT_CHECK(inserted, path_ + ": tensor " + qname(name) + " is stored in both " +
                           files_[it->second.file]->path() + " and " + f.path());
  }
}

std::vector<std::string> SafetensorsFolder::files() const {
  std::vector<std::string> out;
  for (const auto& f : files_) out.push_back(f->path());
  return out;
}

std::vector<std::string> SafetensorsFolder::names() const {
  std::vector<std::string> out;
  out.reserve(index_.size());
  for (const auto& [name, e] : index_) out.push_back(name);
  return out;
}

const TensorView* SafetensorsFolder::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second.view;
}

const SafetensorsFolder::Entry& SafetensorsFolder::entry(std::string_view name) const {
  auto it = index_.find(name);
  FT_CHECK(it != index_.end(), path_ + ": tensor " + qname(name) + " not found (" + std::to_string(index_.size()) +
                                   " tensors in " + std::to_string(files_.size()) + " files)");
  return it->second;
}

const TensorView& SafetensorsFolder::tensor(std::string_view name) const { return *entry(name).view; }

const std::string& SafetensorsFolder::file_of(std::string_view name) const {
  return files_[entry(name).file]->path();
}

const TensorView& SafetensorsFolder::checked(std::string_view name, std::span<const int64_t> expected) const {
  const Entry& e = entry(name);
  const TensorView& v = *e.view;
  FT_CHECK(std::equal(v.shape.begin(), v.shape.end(), expected.begin(), expected.end()),
           files_[e.file]->path() + ": tensor " + qname(name) + " has shape " + shape_str(v.shape) + ", expected " +
               shape_str(expected));
  return v;
}

void SafetensorsFolder::read_f32(std::string_view name, std::span<const int64_t> expected, std::span<float> out) const {
  const TensorView& v = checked(name, expected);
  FT_CHECK(out.size() == static_cast<size_t>(v.numel()),
           "read_f32: output for tensor " + qname(name) + " holds " + std::to_string(out.size()) +
               " floats, the tensor has " + std::to_string(v.numel()));
  convert_to_f32(v.dtype, v.data, v.numel(), out.data());
}

std::vector<float> SafetensorsFolder::to_f32(std::string_view name, std::span<const int64_t> expected) const {
  const TensorView& v = checked(name, expected);
  std::vector<float> out(static_cast<size_t>(v.numel()));
  convert_to_f32(v.dtype, v.data, v.numel(), out.data());
  return out;
}

}  // namespace fasttree
