// Tree file formats (core/tree_io.h): JSON and the artifact's text format.
#include "core/tree_io.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tree_gen.h"

namespace fasttree {
namespace {

namespace fs = std::filesystem;

std::string data_path(const std::string& name) { return std::string(FASTTREE_SOURCE_DIR) + "/data/trees/" + name; }

void expect_same_tree(const KvTree& a, const KvTree& b, const std::string& ctx) {
  EXPECT_EQ(a.parent, b.parent) << ctx;
  EXPECT_EQ(a.slot_begin, b.slot_begin) << ctx;
  EXPECT_EQ(a.slots, b.slots) << ctx;
  EXPECT_EQ(a.query_node, b.query_node) << ctx;
}

// Expects fn() to throw an Error whose message contains every fragment.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> fragments,
                  const std::string& ctx) {
  try {
    fn();
    ADD_FAILURE() << ctx << ": no error";
  } catch (const Error& e) {
    for (const auto& f : fragments) EXPECT_NE(e.message().find(f), std::string::npos) << ctx << ": " << e.message();
  }
}

void expect_json_error(const std::string& text, std::initializer_list<std::string> fragments) {
  expect_error([&] { parse_tree_json(text, "t.json"); }, fragments, text);
  expect_error([&] { parse_tree_json(text, "t.json"); }, {"t.json: "}, text);
}

void expect_text_error(const std::string& text, std::initializer_list<std::string> fragments) {
  expect_error([&] { parse_tree_text(text, "t.txt"); }, fragments, text);
  expect_error([&] { parse_tree_text(text, "t.txt"); }, {"t.txt: "}, text);
}

class TreeIoFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("fasttree_treeio_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const std::string p = (dir_ / name).string();
    std::ofstream(p) << text;
    return p;
  }
  fs::path dir_;
};

TEST(TreeIo, ReadsSmallJson) {
  const KvTree t = load_tree(data_path("small.json"));
  ASSERT_EQ(t.num_nodes(), 7);
  EXPECT_EQ(t.parent, (std::vector<int32_t>{-1, 0, 0, 2, 2, -1, 5}));
  EXPECT_EQ(t.node_len(2), 0);  // empty node
  EXPECT_EQ(std::vector<int32_t>(t.node_slots(1).begin(), t.node_slots(1).end()), (std::vector<int32_t>{8, 9, 10, 11}));
  EXPECT_EQ(std::vector<int32_t>(t.node_slots(4).begin(), t.node_slots(4).end()), (std::vector<int32_t>{40, 41}));
  EXPECT_EQ(t.node_slots(5)[0], 42);  // implicit slots continue after the last stored slot
  EXPECT_EQ(t.query_node, (std::vector<int32_t>{1, 3, 4, 4, 0, 6, 5}));
  EXPECT_EQ(max_slot_plus_one(t), 53);
  expect_same_tree(read_tree_json(data_path("small.json")), t, "read_tree_json");
  // Written back: only node 4 needs explicit slots.
  const std::string js = tree_to_json(t);
  EXPECT_EQ(js.find("\"slots\""), js.rfind("\"slots\"")) << js;
  EXPECT_NE(js.find("\"slots\": [40, 41]"), std::string::npos) << js;
  expect_same_tree(parse_tree_json(js, "rt"), t, "round trip");
}

TEST(TreeIo, ReadsPaperExampleText) {
  const KvTree t = load_tree(data_path("paper_example.txt"));
  ASSERT_EQ(t.num_nodes(), 7);
  EXPECT_EQ(t.parent, (std::vector<int32_t>{-1, 0, 0, 1, 1, 2, 2}));
  EXPECT_EQ(t.node_len(0), 128);
  EXPECT_EQ(t.node_len(2), 64);
  EXPECT_EQ(t.node_len(6), 32);
  EXPECT_EQ(t.query_node, (std::vector<int32_t>{3, 4, 5, 6}));
  EXPECT_EQ(t.num_tokens(), 128 + 2 * 64 + 4 * 32);
  // Same tree as the level generator with the artifact's parent rule.
  expect_same_tree(t, tree_from_levels(std::vector<int64_t>{1, 2, 4}, std::vector<int64_t>{128, 64, 32}), "levels");
  std::ifstream f(data_path("paper_example.txt"));
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(tree_to_text(t), text);
  expect_same_tree(read_tree_text(data_path("paper_example.txt")), t, "read_tree_text");
}

TEST(TreeIo, JsonRoundTripRandomForests) {
  for (uint64_t seed = 0; seed < 200; ++seed) {
    RandomForestSpec spec;
    spec.explicit_slots = seed % 2 == 1;
    spec.shuffle_queries = seed % 3 == 0;
    spec.max_depth = 1 + static_cast<int>(seed % 5);
    const KvTree t = random_forest(spec, seed);
    const std::string js = tree_to_json(t);
    expect_same_tree(parse_tree_json(js, "seed"), t, "seed " + std::to_string(seed));
    if (!spec.explicit_slots) {
      EXPECT_EQ(js.find("slots"), std::string::npos) << "implicit slots written for seed " << seed;
    }
  }
}

TEST(TreeIo, TextRoundTripRandomForests) {
  for (uint64_t seed = 0; seed < 200; ++seed) {
    RandomForestSpec spec;
    spec.max_queries_per_leaf = 1;  // the text format holds exactly one query per leaf
    spec.internal_query_prob = 0;
    spec.max_depth = 1 + static_cast<int>(seed % 6);
    const KvTree t = random_forest(spec, seed);
    const std::string text = tree_to_text(t);
    expect_same_tree(parse_tree_text(text, "seed"), t, "seed " + std::to_string(seed));
    // Text -> JSON -> text is stable too.
    EXPECT_EQ(tree_to_text(parse_tree_json(tree_to_json(parse_tree_text(text, "s")), "s")), text);
  }
}

TEST(TreeIo, JsonImplicitAndExplicitSlots) {
  // Node 1's explicit slots equal the implicit ones; node 2 jumps; node 3 continues after node 2.
  const KvTree t = parse_tree_json(R"({"nodes": [
      {"parent": -1, "len": 3},
      {"parent": 0, "len": 2, "slots": [3, 4]},
      {"parent": 0, "len": 2, "slots": [100, 7]},
      {"parent": 2, "len": 2},
      {"parent": 1, "len": 0, "slots": []}]})",
                                   "mixed");
  EXPECT_EQ(t.slots, (std::vector<int32_t>{0, 1, 2, 3, 4, 100, 7, 8, 9}));
  EXPECT_EQ(t.query_node, (std::vector<int32_t>{3, 4}));  // default: one per leaf, node order
  const std::string js = tree_to_json(t);
  EXPECT_NE(js.find("\"slots\": [100, 7]"), std::string::npos) << js;
  EXPECT_EQ(js.find("\"slots\""), js.rfind("\"slots\"")) << js;  // only node 2
  EXPECT_NE(js.find("\"queries\": [3, 4]"), std::string::npos) << js;
  expect_same_tree(parse_tree_json(js, "rt"), t, "mixed round trip");

  // Explicit queries, an empty list, and unknown keys.
  const KvTree q = parse_tree_json(R"({"name": "x", "nodes": [{"parent": -1, "len": 1, "note": 5}], "queries": []})", "q");
  EXPECT_EQ(q.num_queries(), 0);
  const KvTree e = parse_tree_json(R"({"nodes": []})", "empty");
  EXPECT_EQ(e.num_nodes(), 0);
  expect_same_tree(parse_tree_json(tree_to_json(e), "e"), e, "empty tree");
}

TEST(TreeIo, JsonMalformed) {
  expect_json_error("{\"nodes\": [", {"not valid JSON"});
  expect_json_error("nodes", {"not valid JSON"});
  expect_json_error("[1, 2]", {"not a JSON object"});
  expect_json_error("{\"queries\": [0]}", {"missing \"nodes\""});
  expect_json_error("{\"nodes\": {}}", {"\"nodes\" is not an array"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 1}, 7]})", {"node 1 is not an object"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 1}, {"len": 1}]})", {"node 1", "\"parent\" is missing"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 1}, {"parent": 0}]})", {"node 1", "\"len\" is missing"});
  expect_json_error(R"({"nodes": [{"parent": "0", "len": 1}]})", {"node 0", "\"parent\" is not an integer"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 1.5}]})", {"node 0", "\"len\" is not an integer"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 2}, {"parent": 0, "len": -3}]})",
                    {"node 1", "negative \"len\" -3"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 99999999999}]})", {"node 0", "\"len\"", "out of range"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 3, "slots": [0, 1]}]})",
                    {"node 0", "\"slots\" holds 2 slots but \"len\" is 3"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 2, "slots": [0, "a"]}]})", {"node 0", "slots[1]", "not an integer"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 2, "slots": 5}]})", {"node 0", "\"slots\" is not an array"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 1}], "queries": [0, 0.5]})", {"queries[1]", "not an integer"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 1}], "queries": 0})", {"\"queries\" is not an array"});
  expect_json_error(R"({"nodes": [{"parent": -5, "len": 1}]})", {"node 0", "\"parent\"", "out of range"});
  // validate_tree's findings, prefixed with the source.
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 1}, {"parent": 7, "len": 1}]})", {"t.json: node 1", "parent 7"});
  expect_json_error(R"({"nodes": [{"parent": 1, "len": 1}, {"parent": 0, "len": 1}], "queries": []})",
                    {"t.json: node", "cycle"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 1}], "queries": [0, 3]})", {"t.json: query 1", "node 3"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 2}, {"parent": 0, "len": 1, "slots": [1]}]})",
                    {"t.json: node 1", "slot 1", "twice"});
  expect_json_error(R"({"nodes": [{"parent": -1, "len": 1, "slots": [-4]}]})", {"t.json: node 0", "negative slot"});
}

TEST(TreeIo, TextMalformed) {
  expect_text_error("", {"empty tree file"});
  expect_text_error("two\n-1 0 4 0\n", {"line 1", "node count", "not an integer"});
  expect_text_error("1 2\n-1 0 4 0\n", {"line 1", "single integer"});
  expect_text_error("-1\n", {"node count", "out of range"});
  expect_text_error("3\n-1 0 4 2\n0 1 4 0\n", {"too few lines", "n = 3", "2 node lines"});
  expect_text_error("1\n-1 0 4 0\n0 1 4 0\n", {"too many lines", "line 3"});
  expect_text_error("2\n-1 0 4 1\n0 1 4\n", {"line 3 (node 1)", "expected 4 fields"});
  expect_text_error("2\n-1 0 4 1\n0 1 x 0\n", {"node 1", "'seqlen'", "not an integer: 'x'"});
  expect_text_error("2\n-1 0 4 1\n0 1 4 0.5\n", {"node 1", "'num_children'", "not an integer"});
  expect_text_error("2\n-1 0 4 1\n0 5 4 0\n", {"node 1", "id 5 differs from its position 1"});
  expect_text_error("2\n-1 0 4 1\n9 1 4 0\n", {"node 1", "parent 9 out of range"});
  expect_text_error("2\n-1 0 4 1\n0 1 -4 0\n", {"node 1", "negative seqlen"});
  expect_text_error("2\n-1 0 4 0\n0 1 4 0\n", {"node 0", "num_children is 0 but 1 nodes name it"});
  expect_text_error("3\n-1 0 4 1\n0 1 4 0\n0 2 4 0\n", {"line 2 (node 0)", "num_children is 1 but 2"});
  expect_text_error("2\n1 0 4 1\n0 1 4 1\n", {"t.txt: node", "cycle"});
  // Blank lines, CRLF and extra spaces are fine.
  const KvTree t = parse_tree_text("\n2\r\n\n  -1  0 4 1 \r\n0 1 3 0\r\n\n", "ok");
  EXPECT_EQ(t.parent, (std::vector<int32_t>{-1, 0}));
  EXPECT_EQ(t.num_tokens(), 7);
  EXPECT_EQ(parse_tree_text("0\n", "zero").num_nodes(), 0);
}

TEST_F(TreeIoFiles, TreeIoFilesAndDispatch) {
  RandomForestSpec spec;
  spec.explicit_slots = true;
  const KvTree t = random_forest(spec, 77);
  const std::string jp = (dir_ / "t.json").string();
  write_tree_json(jp, t);
  expect_same_tree(read_tree_json(jp), t, "json file");
  expect_same_tree(load_tree(jp), t, "load_tree json");

  const KvTree lv = tree_from_levels(std::vector<int64_t>{1, 3, 5}, std::vector<int64_t>{10, 4, 2});
  const std::string tp = (dir_ / "t.txt").string();
  write_tree_text(tp, lv);
  expect_same_tree(read_tree_text(tp), lv, "text file");
  expect_same_tree(load_tree(tp), lv, "load_tree text");

  // Leading whitespace before '{' still selects JSON.
  const std::string ws = write("ws.tree", "  \n\t{\"nodes\": [{\"parent\": -1, \"len\": 2}]}");
  EXPECT_EQ(load_tree(ws).num_tokens(), 2);
  // Errors from files name the path.
  const std::string bad = write("bad.json", R"({"nodes": [{"parent": -1}]})");
  expect_error([&] { load_tree(bad); }, {bad + ": node 0", "\"len\""}, "bad.json");
  const std::string missing = (dir_ / "missing.json").string();
  expect_error([&] { load_tree(missing); }, {missing, "cannot open"}, "missing");
  expect_error([&] { read_tree_text(missing); }, {missing}, "missing text");
  expect_error([&] { write_tree_json((dir_ / "no" / "x.json").string(), t); }, {"cannot open for writing"}, "write");
}

}  // namespace
}  // namespace fasttree
