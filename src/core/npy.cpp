#include "core/npy.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <limits>
#include <string_view>

#include "core/error.h"
#include "core/half.h"

namespace fasttree {

static_assert(std::endian::native == std::endian::little, "npy I/O assumes a little-endian host");

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
constexpr int kMaxRank = 64;                            // numpy's own limit
constexpr int64_t kMaxBytes = int64_t{1} << 50;         // anything larger is a corrupt header
constexpr size_t kMaxHeaderLen = size_t{1} << 24;       // likewise

struct NpyHeader {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

// Hand parser for the header dict, a Python literal such as
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& path) : s_(text), path_(path) {}

  NpyHeader parse() {
    NpyHeader h;
    bool seen_descr = false, seen_order = false, seen_shape = false;
    skip_ws();
    expect('{');
    while (true) {
      skip_ws();
      if (peek() == '}') break;
      const std::string key = parse_string("a key");
      skip_ws();
      expect(':');
      skip_ws();
      if (key == "descr") {
        if (peek() != '\'' && peek() != '"') fail("'descr' is not a string (structured dtypes are not supported)");
        h.descr = parse_string("'descr'");
        seen_descr = true;
      } else if (key == "fortran_order") {
        h.fortran_order = parse_bool();
        seen_order = true;
      } else if (key == "shape") {
        h.shape = parse_shape();
        seen_shape = true;
      } else {
        fail("unexpected key '" + key + "'");
      }
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() != '}') fail("expected ',' or '}'");
    }
    ++pos_;
    skip_ws();
    if (pos_ != s_.size()) fail("trailing characters after the dict");
    if (!seen_descr) fail("missing key 'descr'");
    if (!seen_order) fail("missing key 'fortran_order'");
    if (!seen_shape) fail("missing key 'shape'");
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    FT_FAIL(path_ + ": unparsable npy header (" + why + " at offset " + std::to_string(pos_) + "): " +
            printable(s_));
  }
  static std::string printable(std::string_view s) {
    std::string out;
    for (char c : s.substr(0, 200)) out += (c >= 32 && c < 127) ? c : '?';
    while (!out.empty() && (out.back() == ' ' || out.back() == '?')) out.pop_back();
    return out;
  }
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  std::string parse_string(const char* what) {
    const char q = peek();
    if (q != '\'' && q != '"') fail(std::string("expected a quoted string for ") + what);
    const size_t end = s_.find(q, pos_ + 1);
    if (end == std::string_view::npos) fail("unterminated string");
    std::string out(s_.substr(pos_ + 1, end - pos_ - 1));
    pos_ = end + 1;
    return out;
  }
  bool parse_bool() {
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    fail("'fortran_order' is not True or False");
  }
  std::vector<int64_t> parse_shape() {
    std::vector<int64_t> shape;
    expect('(');
    while (true) {
      skip_ws();
      if (peek() == ')') break;
      if (peek() == '-') fail("negative dimension in 'shape'");
      if (peek() < '0' || peek() > '9') fail("'shape' is not a tuple of integers");
      int64_t v = 0;
      while (peek() >= '0' && peek() <= '9') {
        if (v > (std::numeric_limits<int64_t>::max() - 9) / 10) fail("absurd dimension in 'shape'");
        v = v * 10 + (peek() - '0');
        ++pos_;
      }
      if (peek() == 'L') ++pos_;  // Python 2 long suffix
      shape.push_back(v);
      if (shape.size() > static_cast<size_t>(kMaxRank)) fail("more than 64 dimensions in 'shape'");
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() != ')') fail("expected ',' or ')' in 'shape'");
    }
    ++pos_;
    return shape;
  }

  std::string_view s_;
  const std::string& path_;
  size_t pos_ = 0;
};

uint64_t read_le(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "?";
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(std::span<const int64_t> shape, bool wildcard) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += wildcard && shape[i] == -1 ? std::string("*") : std::to_string(shape[i]);
  }
  return s + "]";
}

HostTensor read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FT_CHECK(in.good(), path + ": cannot open file");
  in.seekg(0, std::ios::end);
  const int64_t file_size = static_cast<int64_t>(in.tellg());
  in.seekg(0, std::ios::beg);
  FT_CHECK(file_size >= 0, path + ": cannot determine the file size");

  unsigned char prefix[12] = {};
  const int64_t got = std::min<int64_t>(file_size, 12);
  in.read(reinterpret_cast<char*>(prefix), got);
  FT_CHECK(got >= static_cast<int64_t>(kMagicLen) && std::memcmp(prefix, kMagic, kMagicLen) == 0,
           path + ": not an npy file (bad magic)");
  FT_CHECK(got >= 8, path + ": truncated npy header (no version)");
  const int major = prefix[6], minor = prefix[7];
  FT_CHECK((major == 1 || major == 2 || major == 3) && minor == 0,
           path + ": unsupported npy format version " + std::to_string(major) + "." + std::to_string(minor));
  const int len_bytes = major == 1 ? 2 : 4;
  const int64_t prefix_len = 8 + len_bytes;
  FT_CHECK(file_size >= prefix_len, path + ": truncated npy header (no header length)");
  const uint64_t header_len = read_le(prefix + 8, len_bytes);
  FT_CHECK(header_len <= kMaxHeaderLen, path + ": absurd npy header length " + std::to_string(header_len));
  FT_CHECK(file_size - prefix_len >= static_cast<int64_t>(header_len),
           path + ": truncated npy header (" + std::to_string(header_len) + " header bytes announced, " +
               std::to_string(file_size - prefix_len) + " present)");

  std::string header_text(header_len, '\0');
  in.seekg(prefix_len);
  in.read(header_text.data(), static_cast<std::streamsize>(header_len));
  FT_CHECK(in.good(), path + ": read error in the npy header");

  const NpyHeader h = HeaderParser(header_text, path).parse();
  FT_CHECK(!h.fortran_order, path + ": fortran_order True is not supported (save a C-order array)");
  int item = 0;
  if (h.descr == "<f4") item = 4;
  else if (h.descr == "<f2") item = 2;
  else FT_FAIL(path + ": unsupported dtype '" + h.descr + "' (only '<f4' and '<f2')");

  int64_t numel = 1;
  for (int64_t d : h.shape) {
    FT_CHECK(d == 0 || numel <= kMaxBytes / item / d,
             path + ": absurd shape " + shape_str(h.shape) + " (more than 2^50 bytes)");
    numel *= d;
  }
  const int64_t data_bytes = numel * item;
  const int64_t present = file_size - prefix_len - static_cast<int64_t>(header_len);
  FT_CHECK(present >= data_bytes, path + ": data too short for shape " + shape_str(h.shape) + " " + h.descr +
                                      " (" + std::to_string(data_bytes) + " bytes expected, " +
                                      std::to_string(present) + " present)");
  FT_CHECK(present == data_bytes, path + ": " + std::to_string(present - data_bytes) +
                                      " trailing bytes after the data of shape " + shape_str(h.shape));

  HostTensor t;
  t.shape = h.shape;
  t.data.resize(static_cast<size_t>(numel));
  if (item == 4) {
    in.read(reinterpret_cast<char*>(t.data.data()), static_cast<std::streamsize>(data_bytes));
  } else {
    std::vector<uint16_t> raw(static_cast<size_t>(numel));
    in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(data_bytes));
    for (size_t i = 0; i < raw.size(); ++i) t.data[i] = half_to_float(raw[i]);
  }
  FT_CHECK(numel == 0 || in.good(), path + ": read error in the data");
  return t;
}

void write_npy(const std::string& path, const HostTensor& t, DType dtype) {
  FT_CHECK(dtype != DType::kBF16, path + ": bf16 cannot be stored in .npy (use f32 or f16)");
  for (int64_t d : t.shape) FT_CHECK(d >= 0, path + ": negative dimension in shape " + shape_str(t.shape));
  FT_CHECK(t.numel() == static_cast<int64_t>(t.data.size()),
           path + ": tensor of shape " + shape_str(t.shape) + " holds " + std::to_string(t.data.size()) +
               " values, expected " + std::to_string(t.numel()));
  const bool half = dtype == DType::kF16;

  std::string dict = std::string("{'descr': '") + (half ? "<f2" : "<f4") + "', 'fortran_order': False, 'shape': (";
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (i) dict += ", ";
    dict += std::to_string(t.shape[i]);
  }
  if (t.shape.size() == 1) dict += ",";
  dict += "), }";
  // Pad with spaces and a final newline so that the data starts at a multiple of 64 bytes.
  int major = 1;
  size_t prefix_len = 10;
  if (dict.size() + 1 + prefix_len > 65535) {
    major = 2;
    prefix_len = 12;
  }
  const size_t total = (prefix_len + dict.size() + 1 + 63) / 64 * 64;
  dict.append(total - prefix_len - dict.size() - 1, ' ');
  dict += '\n';

  std::string out(kMagic, kMagicLen);
  out += static_cast<char>(major);
  out += '\0';
  const uint32_t hl = static_cast<uint32_t>(dict.size());
  for (size_t i = 0; i < prefix_len - 8; ++i) out += static_cast<char>((hl >> (8 * i)) & 0xff);
  out += dict;

  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  FT_CHECK(f.good(), path + ": cannot open for writing");
  f.write(out.data(), static_cast<std::streamsize>(out.size()));
  if (half) {
    std::vector<uint16_t> raw(t.data.size());
    for (size_t i = 0; i < raw.size(); ++i) raw[i] = float_to_half(t.data[i]);
    f.write(reinterpret_cast<const char*>(raw.data()), static_cast<std::streamsize>(raw.size() * 2));
  } else {
    f.write(reinterpret_cast<const char*>(t.data.data()), static_cast<std::streamsize>(t.data.size() * 4));
  }
  f.close();
  FT_CHECK(!f.fail(), path + ": write failed");
}

void check_shape(const HostTensor& t, std::span<const int64_t> expected, const std::string& what) {
  bool ok = t.shape.size() == expected.size();
  for (size_t i = 0; ok && i < expected.size(); ++i) ok = expected[i] == -1 || expected[i] == t.shape[i];
  FT_CHECK(ok, what + ": expected shape " + shape_str(expected, true) + ", got " + shape_str(t.shape));
}

}  // namespace fasttree
