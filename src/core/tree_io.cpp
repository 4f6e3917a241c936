#include "core/tree_io.h"

#include <cctype>
#include <charconv>
#include <cstdint>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "core/error.h"

namespace fasttree {

namespace {

using nlohmann::json;

constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FT_CHECK(in.good(), path + ": cannot open file");
  std::ostringstream ss;
  ss << in.rdbuf();
  FT_CHECK(!in.bad(), path + ": read error");
  return ss.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  FT_CHECK(out.good(), path + ": cannot open for writing");
  out << text;
  out.close();
  FT_CHECK(!out.fail(), path + ": write failed");
}

// Runs validate_tree and prefixes its message with the source name.
void validate_named(const KvTree& tree, const std::string& source) {
  try {
    validate_tree(tree);
  } catch (const Error& e) {
    FT_FAIL(source + ": " + e.message());
  }
}

// Nodes without children get one query each, in node order (parents out of range are ignored here;
// validate_tree reports them).
void add_leaf_queries(KvTree& tree) {
  const int n = tree.num_nodes();
  std::vector<uint8_t> has_child(n, 0);
  for (int i = 0; i < n; ++i) {
    const int p = tree.parent[i];
    if (p >= 0 && p < n) has_child[p] = 1;
  }
  for (int i = 0; i < n; ++i)
    if (!has_child[i]) tree.add_query(i);
}

// First slot node i would get from KvTree::add_node(parent, len) given the slots stored before it.
int64_t implicit_first_slot(const KvTree& tree, int node) {
  const int64_t b = tree.slot_begin[node];
  return b == 0 ? 0 : static_cast<int64_t>(tree.slots[b - 1]) + 1;
}

std::string short_dump(const json& v) {
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 37) + "...";
  return s;
}

// An integer JSON value as int64 in [lo, hi]; `where` names the node/field for messages.
int64_t json_int(const json& v, const std::string& where, int64_t lo, int64_t hi) {
  FT_CHECK(v.is_number_integer(), where + " is not an integer (got " + short_dump(v) + ")");
  bool ok;
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    ok = u <= static_cast<uint64_t>(hi);
    x = ok ? static_cast<int64_t>(u) : 0;
  } else {
    x = v.get<int64_t>();
    ok = x >= lo && x <= hi;
  }
  FT_CHECK(ok, where + " = " + v.dump() + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return x;
}

}  // namespace

// ---- JSON ---------------------------------------------------------------------------------------

KvTree parse_tree_json(std::string_view text, const std::string& source_name) {
  const std::string& src = source_name;
  json doc;
  try {
    doc = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    FT_FAIL(src + ": not valid JSON: " + e.what());
  }
  FT_CHECK(doc.is_object(), src + ": the top level is not a JSON object");
  const auto nodes_it = doc.find("nodes");
  FT_CHECK(nodes_it != doc.end(), src + ": missing \"nodes\"");
  FT_CHECK(nodes_it->is_array(), src + ": \"nodes\" is not an array");
  const json& nodes = *nodes_it;
  FT_CHECK(nodes.size() <= static_cast<size_t>(kMaxInt32), src + ": too many nodes");

  KvTree tree;
  std::vector<int32_t> slot_buf;
  for (size_t i = 0; i < nodes.size(); ++i) {
    const std::string where = src + ": node " + std::to_string(i);
    const json& node = nodes[i];
    FT_CHECK(node.is_object(), where + " is not an object (got " + short_dump(node) + ")");
    const auto p_it = node.find("parent");
    FT_CHECK(p_it != node.end(), where + ": \"parent\" is missing");
    const auto parent = static_cast<int>(json_int(*p_it, where + ": \"parent\"", -1, kMaxInt32));
    const auto len_it = node.find("len");
    FT_CHECK(len_it != node.end(), where + ": \"len\" is missing");
    FT_CHECK(!len_it->is_number_integer() || len_it->is_number_unsigned() || len_it->get<int64_t>() >= 0,
             where + ": negative \"len\" " + len_it->dump());
    const int64_t len = json_int(*len_it, where + ": \"len\"", 0, kMaxInt32);
    FT_CHECK(tree.num_tokens() + len <= kMaxInt32, where + ": \"len\" " + std::to_string(len) +
                                                       " makes the tree hold more than 2^31-1 tokens");

    const auto slots_it = node.find("slots");
    if (slots_it != node.end() && !slots_it->is_null()) {
      FT_CHECK(slots_it->is_array(), where + ": \"slots\" is not an array");
      FT_CHECK(slots_it->size() == static_cast<size_t>(len),
               where + ": \"slots\" holds " + std::to_string(slots_it->size()) + " slots but \"len\" is " +
                   std::to_string(len));
      slot_buf.clear();
      for (size_t k = 0; k < slots_it->size(); ++k) {
        slot_buf.push_back(static_cast<int32_t>(json_int((*slots_it)[k], where + ": slots[" + std::to_string(k) + "]",
                                                         std::numeric_limits<int32_t>::min(), kMaxInt32)));
      }
      tree.add_node(parent, slot_buf);
    } else {
      const int64_t first = tree.slots.empty() ? 0 : static_cast<int64_t>(tree.slots.back()) + 1;
      FT_CHECK(len == 0 || first + len - 1 <= kMaxInt32,
               where + ": implicit slots after slot " + std::to_string(first - 1) + " overflow int32");
      tree.add_node(parent, len);
    }
  }

  const auto q_it = doc.find("queries");
  if (q_it != doc.end() && !q_it->is_null()) {
    FT_CHECK(q_it->is_array(), src + ": \"queries\" is not an array");
    for (size_t q = 0; q < q_it->size(); ++q) {
      tree.add_query(static_cast<int>(
          json_int((*q_it)[q], src + ": queries[" + std::to_string(q) + "]", std::numeric_limits<int32_t>::min(), kMaxInt32)));
    }
  } else {
    add_leaf_queries(tree);
  }
  validate_named(tree, src);
  return tree;
}

KvTree read_tree_json(const std::string& path) { return parse_tree_json(read_file(path), path); }

std::string tree_to_json(const KvTree& tree) {
  std::string out = "{\"nodes\": [";
  for (int i = 0; i < tree.num_nodes(); ++i) {
    out += i ? ",\n  " : "\n  ";
    out += "{\"parent\": " + std::to_string(tree.parent[i]) + ", \"len\": " + std::to_string(tree.node_len(i));
    const auto s = tree.node_slots(i);
    const int64_t first = implicit_first_slot(tree, i);
    bool implicit = true;
    for (size_t k = 0; k < s.size() && implicit; ++k) implicit = s[k] == first + static_cast<int64_t>(k);
    if (!implicit) {
      out += ", \"slots\": [";
      for (size_t k = 0; k < s.size(); ++k) {
        if (k) out += ", ";
        out += std::to_string(s[k]);
      }
      out += "]";
    }
    out += "}";
  }
  out += tree.num_nodes() ? "\n],\n\"queries\": [" : "],\n\"queries\": [";
  for (int q = 0; q < tree.num_queries(); ++q) {
    if (q) out += ", ";
    out += std::to_string(tree.query_node[q]);
  }
  out += "]}\n";
  return out;
}

void write_tree_json(const std::string& path, const KvTree& tree) { write_file(path, tree_to_json(tree)); }

// ---- artifact text ------------------------------------------------------------------------------

namespace {

struct TextLine {
  int number;  // 1-based line number in the source
  std::vector<std::string_view> fields;
};

// Non-blank lines split at whitespace.
std::vector<TextLine> split_lines(std::string_view text) {
  std::vector<TextLine> lines;
  int number = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++number;
    TextLine tl{number, {}};
    size_t i = 0;
    while (i < line.size()) {
      while (i < line.size() && std::isspace(static_cast<unsigned char>(line[i]))) ++i;
      const size_t b = i;
      while (i < line.size() && !std::isspace(static_cast<unsigned char>(line[i]))) ++i;
      if (i > b) tl.fields.push_back(line.substr(b, i - b));
    }
    if (!tl.fields.empty()) lines.push_back(std::move(tl));
  }
  return lines;
}

int64_t text_int(std::string_view field, const std::string& where) {
  int64_t v = 0;
  const auto [ptr, ec] = std::from_chars(field.data(), field.data() + field.size(), v);
  FT_CHECK(ec == std::errc() && ptr == field.data() + field.size(),
           where + " is not an integer: '" + std::string(field.substr(0, 40)) + "'");
  return v;
}

}  // namespace

KvTree parse_tree_text(std::string_view text, const std::string& source_name) {
  const std::string& src = source_name;
  const std::vector<TextLine> lines = split_lines(text);
  FT_CHECK(!lines.empty(), src + ": empty tree file (expected the node count n on the first line)");
  const TextLine& head = lines[0];
  const std::string head_where = src + ": line " + std::to_string(head.number) + ": node count n";
  FT_CHECK(head.fields.size() == 1, head_where + ": expected a single integer, got " +
                                        std::to_string(head.fields.size()) + " fields");
  const int64_t n = text_int(head.fields[0], head_where);
  FT_CHECK(n >= 0 && n <= kMaxInt32, head_where + " = " + std::to_string(n) + " is out of range");
  const int64_t present = static_cast<int64_t>(lines.size()) - 1;
  FT_CHECK(present >= n, src + ": too few lines: n = " + std::to_string(n) + " nodes announced, " +
                             std::to_string(present) + " node lines present");
  FT_CHECK(present <= n, src + ": too many lines: n = " + std::to_string(n) + " nodes announced, extra line " +
                             std::to_string(lines[static_cast<size_t>(n) + 1].number));

  static constexpr const char* kFieldNames[4] = {"parent", "id", "seqlen", "num_children"};
  KvTree tree;
  std::vector<int64_t> claimed_children(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const TextLine& line = lines[static_cast<size_t>(i) + 1];
    const std::string where = src + ": line " + std::to_string(line.number) + " (node " + std::to_string(i) + ")";
    FT_CHECK(line.fields.size() == 4, where + ": expected 4 fields 'parent id seqlen num_children', got " +
                                          std::to_string(line.fields.size()));
    int64_t f[4];
    for (int k = 0; k < 4; ++k) f[k] = text_int(line.fields[k], where + ": field '" + kFieldNames[k] + "'");
    FT_CHECK(f[1] == i, where + ": id " + std::to_string(f[1]) + " differs from its position " + std::to_string(i) +
                            " (ids must be 0..n-1 in order)");
    FT_CHECK(f[0] >= -1 && f[0] < n, where + ": parent " + std::to_string(f[0]) + " out of range [-1, " +
                                         std::to_string(n) + ")");
    FT_CHECK(f[2] >= 0, where + ": negative seqlen " + std::to_string(f[2]));
    FT_CHECK(tree.num_tokens() + f[2] <= kMaxInt32,
             where + ": seqlen " + std::to_string(f[2]) + " makes the tree hold more than 2^31-1 tokens");
    FT_CHECK(f[3] >= 0, where + ": negative num_children " + std::to_string(f[3]));
    claimed_children[static_cast<size_t>(i)] = f[3];
    tree.add_node(static_cast<int>(f[0]), f[2]);
  }
  add_leaf_queries(tree);
  validate_named(tree, src);

  std::vector<int64_t> actual(static_cast<size_t>(n), 0);
  for (int i = 0; i < tree.num_nodes(); ++i)
    if (tree.parent[i] >= 0) ++actual[tree.parent[i]];
  for (int64_t i = 0; i < n; ++i) {
    FT_CHECK(claimed_children[i] == actual[i],
             src + ": line " + std::to_string(lines[static_cast<size_t>(i) + 1].number) + " (node " +
                 std::to_string(i) + "): num_children is " + std::to_string(claimed_children[i]) + " but " +
                 std::to_string(actual[i]) + " nodes name it as parent");
  }
  return tree;
}

KvTree read_tree_text(const std::string& path) { return parse_tree_text(read_file(path), path); }

std::string tree_to_text(const KvTree& tree) {
  const int n = tree.num_nodes();
  std::vector<int> num_children(n, 0);
  for (int i = 0; i < n; ++i)
    if (tree.parent[i] >= 0 && tree.parent[i] < n) ++num_children[tree.parent[i]];
  std::string out = std::to_string(n) + "\n";
  for (int i = 0; i < n; ++i) {
    out += std::to_string(tree.parent[i]) + " " + std::to_string(i) + " " + std::to_string(tree.node_len(i)) + " " +
           std::to_string(num_children[i]) + "\n";
  }
  return out;
}

void write_tree_text(const std::string& path, const KvTree& tree) { write_file(path, tree_to_text(tree)); }

// ---- either -------------------------------------------------------------------------------------

KvTree load_tree(const std::string& path) {
  const std::string text = read_file(path);
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i < text.size() && text[i] == '{') return parse_tree_json(text, path);
  return parse_tree_text(text, path);
}

}  // namespace fasttree
