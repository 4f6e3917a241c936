// Safetensors reader/writer (engine/safetensors.h, engine/safetensors_writer.h): round trips in
// every dtype, folders with and without an index, and every malformed input -> one-line error
// naming the file and the tensor.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/half.h"
#include "engine/safetensors.h"
#include "engine/safetensors_writer.h"
#include "engine_test_util.h"

namespace fasttree {
namespace {

using test::expect_error;
using test::random_floats;
using test::TempDir;

// A raw safetensors file: 8-byte length (or `len_override`), header text, data bytes.
std::string raw_file(const std::string& header, const std::string& data, int64_t len_override = -1) {
  const uint64_t len = len_override >= 0 ? static_cast<uint64_t>(len_override) : header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &len, 8);
  return out + header + data;
}

TEST(EngineSafetensors, RoundTripEveryDtype) {
  TempDir dir;
  const auto a = random_floats(6, 1);
  const auto b = random_floats(12, 2, -70000.0f, 70000.0f);  // F16 overflow -> inf is part of the contract
  const auto c = random_floats(5, 3);
  const std::vector<float> scalar = {3.25f};
  const std::vector<SafetensorsTensor> tensors = {
      {"w.f32", DType::kF32, {2, 3}, a},
      {"w.bf16", DType::kBF16, {3, 4}, b},
      {"w.f16", DType::kF16, {5}, c},
      {"scalar", DType::kF32, {}, scalar},
      {"empty", DType::kF16, {0, 3}, {}},
  };
  const std::string path = dir.path("model.safetensors");
  write_safetensors(path, tensors, {{"format", "pt"}});

  SafetensorsFile file(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"empty", "scalar", "w.bf16", "w.f16", "w.f32"}));
  const TensorView& vf = file.tensor("w.f32");
  EXPECT_EQ(vf.dtype, DType::kF32);
  EXPECT_EQ(vf.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(vf.nbytes(), 24u);
  EXPECT_EQ(file.find("nope"), nullptr);

  SafetensorsFolder folder(dir.path());
  EXPECT_EQ(folder.files().size(), 1u);
  EXPECT_EQ(folder.file_of("w.f16"), path);
  EXPECT_EQ(folder.to_f32("w.f32", std::vector<int64_t>{2, 3}), a);
  const auto rb = folder.to_f32("w.bf16", std::vector<int64_t>{3, 4});
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(rb[i], bf16_to_float(float_to_bf16(b[i])));
  const auto rc = folder.to_f32("w.f16", std::vector<int64_t>{5});
  for (size_t i = 0; i < c.size(); ++i) EXPECT_EQ(rc[i], half_to_float(float_to_half(c[i])));
  EXPECT_EQ(folder.to_f32("scalar", std::vector<int64_t>{}), scalar);
  EXPECT_TRUE(folder.to_f32("empty", std::vector<int64_t>{0, 3}).empty());
  EXPECT_EQ(folder.tensor("w.bf16").dtype, DType::kBF16);
  // Every tensor starts 8-byte aligned in the mapping (header padded, tensors in name order).
  EXPECT_EQ(reinterpret_cast<uintptr_t>(folder.tensor("empty").data) % 8, 0u);

  expect_error([&] { folder.to_f32("w.f32", std::vector<int64_t>{3, 2}); },
               {path, "'w.f32'", "[2, 3]", "expected [3, 2]"}, "shape mismatch");
  expect_error([&] { folder.to_f32("w.f32", std::vector<int64_t>{2, 3, 1}); }, {"'w.f32'", "[2, 3, 1]"}, "rank");
  expect_error([&] { folder.tensor("missing.weight"); }, {dir.path(), "'missing.weight'", "not found"}, "absent");
  std::vector<float> small(5);
  expect_error([&] { folder.read_f32("w.f32", std::vector<int64_t>{2, 3}, small); }, {"'w.f32'", "5"}, "out size");

  // A single file path opens too.
  SafetensorsFolder single(path);
  EXPECT_EQ(single.names().size(), 5u);
}

TEST(EngineSafetensors, WriterRejectsBadInput) {
  TempDir dir;
  const auto a = random_floats(4, 7);
  const std::string p = dir.path("x.safetensors");
  expect_error([&] { write_safetensors(p, std::vector<SafetensorsTensor>{{"t", DType::kF32, {3}, a}}); },
               {"'t'", "4 values", "[3]"});
  expect_error([&] {
    write_safetensors(p, std::vector<SafetensorsTensor>{{"t", DType::kF32, {4}, a}, {"t", DType::kF32, {4}, a}});
  }, {"'t'", "twice"});
  expect_error([&] { write_safetensors(p, std::vector<SafetensorsTensor>{{"__metadata__", DType::kF32, {4}, a}}); },
               {"__metadata__"});
  expect_error([&] { write_safetensors(p, std::vector<SafetensorsTensor>{{"t", DType::kF32, {-4}, a}}); },
               {"'t'", "negative"});
  expect_error([&] { write_safetensors(dir.path("no/such/dir/x.safetensors"), {}); }, {"cannot open"});
}

TEST(EngineSafetensors, MalformedFiles) {
  TempDir dir;
  const std::string data8(8, '\x01');  // two F32 values
  const std::string ok_entry = R"("a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})";
  struct Case {
    const char* name;
    std::string bytes;
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {"short", std::string("\x05\x00\x00", 3), {"shorter than the 8-byte"}},
      {"len_beyond", raw_file("{" + ok_entry + "}", data8, 1000), {"header length 1000", "exceeds the file"}},
      {"huge_len", raw_file("{}", "", int64_t{1} << 62), {"exceeds the file"}},
      {"bad_json", raw_file(R"({"a": {"dtype": "F32", )", data8), {"not valid JSON"}},
      {"not_object", raw_file("[1, 2]", ""), {"not a JSON object"}},
      {"duplicate", raw_file("{" + ok_entry + ", " + ok_entry + "}", data8), {"tensor 'a'", "twice"}},
      {"dtype_i64", raw_file(R"({"ids": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})", data8),
       {"tensor 'ids'", "dtype I64 is not supported", "BF16, F16, F32"}},
      {"dtype_unknown", raw_file(R"({"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 8]}})", data8),
       {"tensor 'w'", "unknown dtype 'Q7'"}},
      {"dtype_not_string", raw_file(R"({"w": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}})", data8),
       {"tensor 'w'", "'dtype' is not a string"}},
      {"entry_not_object", raw_file(R"({"w": [1, 2]})", data8), {"tensor 'w'", "not an object"}},
      {"missing_shape", raw_file(R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", data8),
       {"tensor 'w'", "missing field 'shape'"}},
      {"missing_offsets", raw_file(R"({"w": {"dtype": "F32", "shape": [2]}})", data8),
       {"tensor 'w'", "missing field 'data_offsets'"}},
      {"negative_dim", raw_file(R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", data8),
       {"tensor 'w'", "shape[0]", "non-negative integer"}},
      {"float_dim", raw_file(R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", data8),
       {"tensor 'w'", "shape[0]"}},
      {"shape_not_array", raw_file(R"({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})", data8),
       {"tensor 'w'", "'shape' is not an array"}},
      {"offsets_arity", raw_file(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", data8),
       {"tensor 'w'", "'data_offsets' is not an array [begin, end]"}},
      {"offsets_reversed", raw_file(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}})", data8),
       {"tensor 'w'", "end before begin"}},
      {"size_mismatch", raw_file(R"({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 8]}})", data8),
       {"tensor 'w'", "hold 8 bytes", "[2] BF16 needs 4"}},
      {"out_of_bounds", raw_file(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", data8),
       {"tensor 'w'", "out of bounds", "8-byte data buffer"}},
      {"overlap",
       raw_file(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}})",
                data8),
       {"tensors 'a' and 'b' overlap"}},
      {"absurd_shape",
       raw_file(R"({"w": {"dtype": "F32", "shape": [1000000000, 1000000000], "data_offsets": [0, 8]}})", data8),
       {"tensor 'w'", "absurdly large"}},
  };
  for (const Case& c : cases) {
    const std::string p = dir.write(std::string(c.name) + ".safetensors", c.bytes);
    std::vector<std::string> frags = c.fragments;
    frags.push_back(p);
    try {
      SafetensorsFile f(p);
      ADD_FAILURE() << c.name << ": no error";
    } catch (const Error& e) {
      const std::string msg = e.message();
      EXPECT_EQ(msg.find('\n'), std::string::npos) << c.name << ": " << msg;
      for (const std::string& frag : frags)
        EXPECT_NE(msg.find(frag), std::string::npos) << c.name << ": '" << frag << "' not in: " << msg;
    }
  }
  // Still valid: metadata ignored, holes allowed, empty tensors anywhere, duplicate keys inside
  // __metadata__ are not tensor names.
  const std::string good = raw_file(
      R"({"__metadata__": {"format": "pt", "format": "pt"},
          "a": {"dtype": "F16", "shape": [1], "data_offsets": [6, 8]},
          "e": {"dtype": "F32", "shape": [0, 4], "data_offsets": [6, 6]}})",
      data8);
  SafetensorsFile f(dir.write("good.safetensors", good));
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "e"}));
  // Not a file at all.
  expect_error([&] { SafetensorsFile x(dir.path("absent.safetensors")); }, {"absent.safetensors", "cannot open"});
  expect_error([&] { SafetensorsFile x(dir.path()); }, {"not a regular file"});
}

TEST(EngineSafetensors, ShardedFolders) {
  TempDir dir;
  const auto a = random_floats(8, 11);
  const auto b = random_floats(6, 12);
  write_safetensors(dir.path("model-00001-of-00002.safetensors"),
                    std::vector<SafetensorsTensor>{{"a", DType::kBF16, {2, 4}, a}});
  write_safetensors(dir.path("model-00002-of-00002.safetensors"),
                    std::vector<SafetensorsTensor>{{"b", DType::kF32, {6}, b}});
  {
    SafetensorsFolder folder(dir.path());  // no index: every *.safetensors
    EXPECT_EQ(folder.names(), (std::vector<std::string>{"a", "b"}));
    EXPECT_EQ(folder.to_f32("b", std::vector<int64_t>{6}), b);
    EXPECT_EQ(folder.file_of("a"), dir.path("model-00001-of-00002.safetensors"));
  }
  const std::string index = dir.path("model.safetensors.index.json");
  dir.write("model.safetensors.index.json",
            R"({"metadata": {"total_size": 40}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                "b": "model-00002-of-00002.safetensors"}})");
  {
    SafetensorsFolder folder(dir.path());
    EXPECT_EQ(folder.files().size(), 2u);
    EXPECT_EQ(folder.names(), (std::vector<std::string>{"a", "b"}));
  }
  // The index names a shard that does not hold the tensor.
  dir.write("model.safetensors.index.json",
            R"({"weight_map": {"a": "model-00002-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})");
  expect_error([&] { SafetensorsFolder f(dir.path()); }, {index, "tensor 'a'", "not stored there"}, "wrong shard");
  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": "missing.safetensors"}})");
  expect_error([&] { SafetensorsFolder f(dir.path()); }, {"missing.safetensors", "cannot open"}, "missing shard");
  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": "../escape.safetensors"}})");
  expect_error([&] { SafetensorsFolder f(dir.path()); }, {index, "'a'", "not a file name"}, "path escape");
  dir.write("model.safetensors.index.json", R"({"weight_map": {"a": 3}})");
  expect_error([&] { SafetensorsFolder f(dir.path()); }, {index, "'a'"}, "not a string");
  dir.write("model.safetensors.index.json", R"({"metadata": {}})");
  expect_error([&] { SafetensorsFolder f(dir.path()); }, {index, "weight_map"}, "no weight_map");
  dir.write("model.safetensors.index.json", R"({"weight_map": )");
  expect_error([&] { SafetensorsFolder f(dir.path()); }, {index, "not valid JSON"}, "bad index");
  std::filesystem::remove(index);

  // The same tensor in two shards.
  write_safetensors(dir.path("model-extra.safetensors"), std::vector<SafetensorsTensor>{{"b", DType::kF32, {6}, b}});
  expect_error([&] { SafetensorsFolder f(dir.path()); }, {"tensor 'b'", "stored in both"}, "duplicate");

  TempDir empty_dir_holder;  // distinct folder without any safetensors
  const std::string empty = empty_dir_holder.path("empty");
  std::filesystem::create_directories(empty);
  expect_error([&] { SafetensorsFolder f(empty); }, {empty, "no *.safetensors"}, "empty folder");
  expect_error([&] { SafetensorsFolder f(dir.path("nowhere")); }, {"nowhere", "no such checkpoint"}, "absent");
}

}  // namespace
}  // namespace fasttree
