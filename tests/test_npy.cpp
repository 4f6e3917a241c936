// .npy reading/writing (core/npy.h): round trips, files written by numpy, malformed files.
#include "core/npy.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"

namespace fasttree {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test (tests may run in parallel processes).
class NpyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("fasttree_npy_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::string write_bytes(const std::string& name, const std::string& bytes) const {
    const std::string p = path(name);
    std::ofstream f(p, std::ios::binary);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }
  std::string read_bytes(const std::string& p) const {
    std::ifstream f(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  }
  // Expects read_npy(file) to throw an Error whose message contains every fragment and the path.
  void expect_read_error(const std::string& name, const std::string& bytes,
                         std::initializer_list<const char*> fragments) {
    const std::string p = write_bytes(name, bytes);
    try {
      read_npy(p);
      ADD_FAILURE() << name << ": no error";
    } catch (const Error& e) {
      const std::string msg = e.message();
      EXPECT_NE(msg.find(p), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << "multi-line message: " << msg;
      for (const char* f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << name << ": " << msg;
    }
  }

  fs::path dir_;
};

template <size_t N>
std::string bytes(const char (&lit)[N]) {
  return std::string(lit, N - 1);
}

// Builds an npy file from a header dict (padded to 64 bytes like numpy) and raw data bytes.
std::string make_npy(const std::string& dict, const std::string& data, int major = 1) {
  const size_t prefix = major == 1 ? 10 : 12;
  std::string header = dict;
  while ((prefix + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += '\0';
  for (size_t i = 0; i < prefix - 8; ++i) out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string f32_bytes(std::initializer_list<float> values) {
  std::string s;
  for (float v : values) s.append(reinterpret_cast<const char*>(&v), 4);
  return s;
}

HostTensor random_tensor(std::vector<int64_t> shape, uint64_t seed) {
  HostTensor t;
  t.shape = std::move(shape);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  t.data.resize(static_cast<size_t>(t.numel()));
  for (float& v : t.data) v = dist(rng);
  return t;
}

// ---- files written by numpy 2.4 (np.save / np.lib.format.write_array), bytes verbatim -----------

// np.array([[1.5, -2.25, 3.0], [0.1, 1e-3, -7.75]], dtype='<f4')
const std::string kNumpyF4 = bytes(
    "\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }                                                          \n\x00\x00\xc0?\x00\x00\x10\xc0\x00\x00@@\xcd\xcc\xcc=o\x12\x83:\x00\x00\xf8\xc0");
// np.array([0.5, -1.0, 65504.0, 6e-8, np.inf], dtype='<f2')
const std::string kNumpyF2 = bytes(
    "\x93NUMPY\x01\x00v\x00{'descr': '<f2', 'fortran_order': False, 'shape': (5,), }                                                            \n\x00" "8\x00\xbc\xff{\x01\x00\x00|");
// np.array(3.25, dtype='<f4')
const std::string kNumpyScalar = bytes(
    "\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (), }                                                              \n\x00\x00P@");
// np.zeros((0, 4), dtype='<f4')
const std::string kNumpyEmpty = bytes(
    "\x93NUMPY\x01\x00v\x00{'descr': '<f4', 'fortran_order': False, 'shape': (0, 4), }                                                          \n");
// The 2x3 array above with version=(2, 0); the f2 array reshaped to (1, 5) with version=(3, 0).
const std::string kNumpyV2 = bytes(
    "\x93NUMPY\x02\x00t\x00\x00\x00{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }                                                        \n\x00\x00\xc0?\x00\x00\x10\xc0\x00\x00@@\xcd\xcc\xcc=o\x12\x83:\x00\x00\xf8\xc0");
const std::string kNumpyV3 = bytes(
    "\x93NUMPY\x03\x00t\x00\x00\x00{'descr': '<f2', 'fortran_order': False, 'shape': (1, 5), }                                                        \n\x00" "8\x00\xbc\xff{\x01\x00\x00|");

TEST_F(NpyTest, NpyReadsNumpyFiles) {
  HostTensor a = read_npy(write_bytes("a.npy", kNumpyF4));
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.data, (std::vector<float>{1.5f, -2.25f, 3.0f, 0.1f, 1e-3f, -7.75f}));

  HostTensor h = read_npy(write_bytes("h.npy", kNumpyF2));
  EXPECT_EQ(h.shape, (std::vector<int64_t>{5}));
  ASSERT_EQ(h.data.size(), 5u);
  EXPECT_EQ(h.data[0], 0.5f);
  EXPECT_EQ(h.data[1], -1.0f);
  EXPECT_EQ(h.data[2], 65504.0f);
  EXPECT_EQ(h.data[3], std::ldexp(1.0f, -24));  // 6e-8 rounds to the smallest subnormal
  EXPECT_TRUE(std::isinf(h.data[4]));

  HostTensor s = read_npy(write_bytes("s.npy", kNumpyScalar));
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.data, std::vector<float>{3.25f});

  HostTensor z = read_npy(write_bytes("z.npy", kNumpyEmpty));
  EXPECT_EQ(z.shape, (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(z.data.empty());

  HostTensor v2 = read_npy(write_bytes("v2.npy", kNumpyV2));
  EXPECT_EQ(v2.shape, a.shape);
  EXPECT_EQ(v2.data, a.data);
  HostTensor v3 = read_npy(write_bytes("v3.npy", kNumpyV3));
  EXPECT_EQ(v3.shape, (std::vector<int64_t>{1, 5}));
  EXPECT_EQ(v3.data[1], -1.0f);
}

// write_npy produces byte-identical files to numpy for the same arrays.
TEST_F(NpyTest, NpyWritesLikeNumpy) {
  HostTensor a{{2, 3}, {1.5f, -2.25f, 3.0f, 0.1f, 1e-3f, -7.75f}};
  write_npy(path("a.npy"), a);
  EXPECT_EQ(read_bytes(path("a.npy")), kNumpyF4);

  HostTensor h{{5}, {0.5f, -1.0f, 65504.0f, 6e-8f, INFINITY}};
  write_npy(path("h.npy"), h, DType::kF16);
  EXPECT_EQ(read_bytes(path("h.npy")), kNumpyF2);

  HostTensor s{{}, {3.25f}};
  write_npy(path("s.npy"), s);
  EXPECT_EQ(read_bytes(path("s.npy")), kNumpyScalar);

  HostTensor z{{0, 4}, {}};
  write_npy(path("z.npy"), z);
  EXPECT_EQ(read_bytes(path("z.npy")), kNumpyEmpty);
}

TEST_F(NpyTest, NpyRoundTripF32) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {1}, {7}, {3, 5}, {4, 2, 8}, {2, 3, 4, 5}, {0}, {3, 0, 2}};
  uint64_t seed = 1;
  for (const auto& shape : shapes) {
    const HostTensor t = random_tensor(shape, seed++);
    write_npy(path("t.npy"), t);
    const HostTensor r = read_npy(path("t.npy"));
    EXPECT_EQ(r.shape, t.shape);
    EXPECT_EQ(r.data, t.data);  // bit-exact
    EXPECT_EQ(fs::file_size(path("t.npy")) % 64, (t.data.size() * 4) % 64);  // data 64-aligned
  }
}

TEST_F(NpyTest, NpyRoundTripF16) {
  const HostTensor t = random_tensor({16, 4, 64}, 42);
  write_npy(path("t.npy"), t, DType::kF16);
  EXPECT_EQ(fs::file_size(path("t.npy")), 128u + t.data.size() * 2);
  const HostTensor r = read_npy(path("t.npy"));
  EXPECT_EQ(r.shape, t.shape);
  ASSERT_EQ(r.data.size(), t.data.size());
  int nonzero = 0;
  for (size_t i = 0; i < t.data.size(); ++i) {
    EXPECT_EQ(r.data[i], half_to_float(float_to_half(t.data[i])));
    EXPECT_NEAR(r.data[i], t.data[i], std::abs(t.data[i]) * 1e-3 + 1e-7);
    nonzero += r.data[i] != 0.0f;
  }
  EXPECT_GT(nonzero, static_cast<int>(t.data.size()) - 5);
  // A second round trip of fp16 data is exact.
  write_npy(path("t2.npy"), r, DType::kF16);
  EXPECT_EQ(read_npy(path("t2.npy")).data, r.data);
}

TEST_F(NpyTest, NpyRank64RoundTripAndRank65Rejected) {
  HostTensor t;
  t.shape.assign(64, 1);
  t.shape[0] = 2;
  t.shape[63] = 3;
  t = random_tensor(t.shape, 9);
  write_npy(path("t.npy"), t);
  const HostTensor r = read_npy(path("t.npy"));
  EXPECT_EQ(r.shape, t.shape);
  EXPECT_EQ(r.data, t.data);
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  for (int i = 0; i < 65; ++i) dict += "1, ";
  expect_read_error("r65.npy", make_npy(dict + "), }", f32_bytes({1.0f})), {"more than 64 dimensions"});
}

TEST_F(NpyTest, NpyHeaderVariants) {
  const std::string data = f32_bytes({1.0f, -2.0f, 3.5f, 4.0f, 5.0f, 6.0f});
  const std::vector<std::pair<std::string, std::vector<int64_t>>> ok = {
      {"{'shape': (2, 3), 'fortran_order': False, 'descr': '<f4'}", {2, 3}},
      {"{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (6,)}", {6}},
      {"{ 'descr' : '<f4' , 'fortran_order' : False , 'shape' : ( 6 , ) , }", {6}},
      {"{'descr':'<f4','fortran_order':False,'shape':(1,2,3)}", {1, 2, 3}},
      {"{'descr': '<f4',\n 'fortran_order': False,\n 'shape': (3, 2,)}", {3, 2}},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (6L,), }", {6}},
  };
  for (const auto& [dict, shape] : ok) {
    const HostTensor t = read_npy(write_bytes("v.npy", make_npy(dict, data)));
    EXPECT_EQ(t.shape, shape) << dict;
    EXPECT_EQ(t.data[2], 3.5f) << dict;
  }
  // Scalar with an unpadded header and no trailing newline.
  std::string raw = "\x93NUMPY";
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': ()}";
  raw += std::string("\x01\x00", 2);
  raw += static_cast<char>(dict.size());
  raw += '\0';
  raw += dict + f32_bytes({9.5f});
  const HostTensor s = read_npy(write_bytes("s.npy", raw));
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(s.data, std::vector<float>{9.5f});
}

TEST_F(NpyTest, NpyRejectsMissingFileAndBadMagic) {
  try {
    read_npy(path("nope.npy"));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(path("nope.npy")), std::string::npos);
    EXPECT_NE(e.message().find("cannot open"), std::string::npos) << e.message();
  }
  expect_read_error("empty.npy", "", {"bad magic"});
  expect_read_error("text.npy", "hello world, this is not numpy at all", {"bad magic"});
  expect_read_error("magic.npy", std::string("\x93NUMPZ\x01\x00", 8) + std::string(120, ' '), {"bad magic"});
}

TEST_F(NpyTest, NpyRejectsTruncatedHeaders) {
  expect_read_error("t1.npy", std::string("\x93NUMPY", 6), {"truncated"});
  expect_read_error("t2.npy", std::string("\x93NUMPY\x01\x00", 8), {"truncated"});
  expect_read_error("t3.npy", std::string("\x93NUMPY\x01\x00\x76", 9), {"truncated"});
  expect_read_error("t4.npy", kNumpyF4.substr(0, 60), {"truncated", "118 header bytes"});
  expect_read_error("t5.npy", std::string("\x93NUMPY\x02\x00\x76\x00", 10), {"truncated"});
  expect_read_error("v4.npy", std::string("\x93NUMPY\x04\x00", 8) + kNumpyF4.substr(8), {"version 4.0"});
}

TEST_F(NpyTest, NpyRejectsUnparsableHeaders) {
  const std::string d = f32_bytes({1, 2});
  const std::vector<std::pair<std::string, const char*>> bad = {
      {"'descr': '<f4', 'fortran_order': False, 'shape': (2,)", "expected '{'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)", "expected ',' or '}'"},
      {"{'descr': '<f4' 'fortran_order': False, 'shape': (2,)}", "expected ',' or '}'"},
      {"{'descr': '<f4', 'fortran_order': False}", "missing key 'shape'"},
      {"{'fortran_order': False, 'shape': (2,)}", "missing key 'descr'"},
      {"{'descr': '<f4', 'shape': (2,)}", "missing key 'fortran_order'"},
      {"{'descr': '<f4', 'fortran_order': false, 'shape': (2,)}", "not True or False"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': [2]}", "expected '('"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2.0,)}", "expected ',' or ')'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (two,)}", "not a tuple of integers"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'extra': 1}", "unexpected key 'extra'"},
      {"{descr: '<f4', 'fortran_order': False, 'shape': (2,)}", "quoted string"},
      {"{'descr: '<f4', 'fortran_order': False, 'shape': (2,)}", "expected ':'"},
      {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,)}", "structured"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk", "trailing characters"},
      {"", "expected '{'"},
  };
  int i = 0;
  for (const auto& [dict, why] : bad) {
    expect_read_error("h" + std::to_string(i++) + ".npy", make_npy(dict, d), {"unparsable npy header", why});
  }
}

TEST_F(NpyTest, NpyRejectsFortranOrderAndOtherDtypes) {
  const std::string d = f32_bytes({1, 2, 3, 4, 5, 6});
  expect_read_error("f.npy", make_npy("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", d),
                    {"fortran_order True"});
  for (const char* dt : {"<f8", ">f4", "<i4", "|u1", ">f2", "<c8", "float32"}) {
    expect_read_error(
        "d.npy", make_npy(std::string("{'descr': '") + dt + "', 'fortran_order': False, 'shape': (6,), }", d + d),
        {"unsupported dtype", dt});
  }
}

TEST_F(NpyTest, NpyRejectsBadShapesAndSizes) {
  const std::string d = f32_bytes({1, 2, 3, 4, 5, 6});
  expect_read_error("neg.npy", make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (-1, 3), }", d),
                    {"negative dimension"});
  expect_read_error("huge.npy",
                    make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999,), }", d),
                    {"absurd"});
  expect_read_error("big.npy",
                    make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 1000000000), }", d),
                    {"absurd shape"});
  expect_read_error("short.npy", make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), }", d),
                    {"data too short", "[2, 4]", "32 bytes expected, 24 present"});
  expect_read_error("short2.npy", make_npy("{'descr': '<f2', 'fortran_order': False, 'shape': (13,), }", d),
                    {"data too short", "[13]"});
  expect_read_error("long.npy", make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }", d),
                    {"4 trailing bytes", "[5]"});
  expect_read_error("long0.npy", make_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 3), }", d),
                    {"24 trailing bytes"});
}

TEST_F(NpyTest, NpyWriteRejectsBadInput) {
  HostTensor t{{2, 2}, {1, 2, 3, 4}};
  EXPECT_THROW(write_npy(path("b.npy"), t, DType::kBF16), Error);
  HostTensor wrong{{2, 3}, {1, 2, 3, 4}};
  try {
    write_npy(path("w.npy"), wrong);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("[2, 3]"), std::string::npos) << e.message();
  }
  EXPECT_THROW(write_npy((dir_ / "no_such_dir" / "x.npy").string(), t), Error);
}

TEST(Npy, CheckShape) {
  HostTensor t{{4, 32, 64}, std::vector<float>(4 * 32 * 64)};
  const std::vector<int64_t> good = {4, 32, 64};
  const std::vector<int64_t> wild = {-1, 32, -1};
  EXPECT_NO_THROW(check_shape(t, good, "q.npy"));
  EXPECT_NO_THROW(check_shape(t, wild, "q.npy"));
  const std::vector<int64_t> bad = {4, 32, 128};
  try {
    check_shape(t, bad, "q.npy");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "q.npy: expected shape [4, 32, 128], got [4, 32, 64]");
  }
  const std::vector<int64_t> rank = {-1, 32};
  try {
    check_shape(t, rank, "k.npy");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "k.npy: expected shape [*, 32], got [4, 32, 64]");
  }
  HostTensor s{{}, {1.0f}};
  EXPECT_NO_THROW(check_shape(s, std::span<const int64_t>(), "s"));
  EXPECT_EQ(std::string(dtype_name(DType::kBF16)), "bf16");
}

}  // namespace
}  // namespace fasttree
