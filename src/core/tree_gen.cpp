#include "core/tree_gen.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <numeric>
#include <random>

#include "core/error.h"

namespace fasttree {

namespace {

constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxGeneratedNodes = int64_t{1} << 24;

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Portable (library-independent) draws so that a seed gives the same forest everywhere.
class Draw {
 public:
  explicit Draw(uint64_t seed) : rng_(seed) {}
  int64_t uniform(int64_t lo, int64_t hi) {  // inclusive; hi >= lo
    const uint64_t range = static_cast<uint64_t>(hi - lo) + 1;
    return lo + static_cast<int64_t>(rng_() % range);  // bias negligible for the small ranges used
  }
  bool bernoulli(double p) { return static_cast<double>(rng_() >> 11) * 0x1p-53 < p; }

 private:
  std::mt19937_64 rng_;
};

}  // namespace

std::vector<int64_t> parse_int_list(std::string_view text, const std::string& what) {
  std::vector<int64_t> out;
  size_t pos = 0;
  for (int index = 0;; ++index) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string_view item = trim(text.substr(pos, comma - pos));
    const std::string where = what + ": item " + std::to_string(index) + " of '" + std::string(text) + "'";
    FT_CHECK(!item.empty(), where + " is empty");
    int64_t v = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    FT_CHECK(ec != std::errc::result_out_of_range, where + " ('" + std::string(item) + "') is too large");
    FT_CHECK(ec == std::errc() && ptr == item.data() + item.size(),
             where + " ('" + std::string(item) + "') is not a number");
    FT_CHECK(v >= 0, where + " is negative (" + std::to_string(v) + ")");
    out.push_back(v);
    if (comma == text.size()) break;
    pos = comma + 1;
  }
  return out;
}

KvTree tree_from_levels(std::span<const int64_t> counts, std::span<const int64_t> lens) {
  FT_CHECK(counts.size() == lens.size(), "tree levels: " + std::to_string(counts.size()) + " node counts but " +
                                             std::to_string(lens.size()) + " lengths");
  FT_CHECK(!counts.empty(), "tree levels: no levels given");
  int64_t nodes = 0, tokens = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const std::string where = "tree levels: level " + std::to_string(i);
    FT_CHECK(counts[i] > 0, where + ": node count must be positive, got " + std::to_string(counts[i]));
    FT_CHECK(lens[i] >= 0, where + ": negative length " + std::to_string(lens[i]));
    FT_CHECK(counts[i] <= kMaxGeneratedNodes && nodes + counts[i] <= kMaxGeneratedNodes,
             where + ": more than " + std::to_string(kMaxGeneratedNodes) + " nodes in total");
    nodes += counts[i];
    FT_CHECK(lens[i] <= kMaxInt32 && tokens + counts[i] * lens[i] <= kMaxInt32,
             where + ": the tree would hold more than 2^31-1 tokens");
    tokens += counts[i] * lens[i];
  }
  KvTree tree;
  int64_t prev_first = 0;  // id of the first node of the previous level
  for (size_t i = 0; i < counts.size(); ++i) {
    const int64_t first = tree.num_nodes();
    for (int64_t j = 0; j < counts[i]; ++j) {
      int64_t parent = -1;
      if (i > 0) {
        const int64_t p = (j * counts[i - 1]) / counts[i];
        FT_CHECK(p >= 0 && p < counts[i - 1], "tree levels: level " + std::to_string(i) + " node " +
                                                   std::to_string(j) + ": parent index " + std::to_string(p) +
                                                   " outside the previous level");
        parent = prev_first + p;
      }
      tree.add_node(static_cast<int>(parent), lens[i]);
    }
    prev_first = first;
  }
  for (int64_t v = prev_first; v < tree.num_nodes(); ++v) tree.add_query(static_cast<int>(v));
  return tree;
}

KvTree random_forest(const RandomForestSpec& spec, uint64_t seed) {
  FT_CHECK(spec.min_roots >= 1 && spec.max_roots >= spec.min_roots,
           "random_forest: need 1 <= min_roots <= max_roots, got " + std::to_string(spec.min_roots) + ".." +
               std::to_string(spec.max_roots));
  FT_CHECK(spec.max_depth >= 1, "random_forest: max_depth must be >= 1");
  FT_CHECK(spec.max_fanout >= 0, "random_forest: max_fanout must be >= 0");
  FT_CHECK(spec.min_len >= 0 && spec.max_len >= spec.min_len && spec.max_len <= kMaxInt32,
           "random_forest: need 0 <= min_len <= max_len, got " + std::to_string(spec.min_len) + ".." +
               std::to_string(spec.max_len));
  FT_CHECK(spec.max_queries_per_leaf >= 1, "random_forest: max_queries_per_leaf must be >= 1");
  FT_CHECK(spec.empty_node_prob >= 0 && spec.empty_node_prob <= 1 && spec.internal_query_prob >= 0 &&
               spec.internal_query_prob <= 1,
           "random_forest: probabilities must lie in [0, 1]");

  Draw draw(seed);
  std::vector<int32_t> parent, depth, num_children;
  const int64_t roots = draw.uniform(spec.min_roots, spec.max_roots);
  for (int64_t r = 0; r < roots; ++r) {
    parent.push_back(-1);
    depth.push_back(1);
  }
  // Breadth-first growth: parents always precede their children.
  for (size_t v = 0; v < parent.size(); ++v) {
    int64_t k = 0;
    if (depth[v] < spec.max_depth) {
      k = draw.uniform(0, spec.max_fanout);
      if (depth[v] == 1) k = std::max<int64_t>(k, std::min(1, spec.max_fanout));
    }
    FT_CHECK(static_cast<int64_t>(parent.size()) + k <= kMaxGeneratedNodes,
             "random_forest: more than " + std::to_string(kMaxGeneratedNodes) + " nodes; lower max_fanout/max_depth");
    num_children.push_back(static_cast<int32_t>(k));
    for (int64_t c = 0; c < k; ++c) {
      parent.push_back(static_cast<int32_t>(v));
      depth.push_back(depth[v] + 1);
    }
  }
  const int n = static_cast<int>(parent.size());
  std::vector<int64_t> len(n);
  int64_t total = 0;
  for (int v = 0; v < n; ++v) {
    len[v] = draw.bernoulli(spec.empty_node_prob) ? 0 : draw.uniform(spec.min_len, spec.max_len);
    total += len[v];
    FT_CHECK(total <= kMaxInt32 / 2 - 16, "random_forest: more than 2^30 tokens; lower max_len");
  }

  KvTree tree;
  if (spec.explicit_slots) {
    std::vector<int32_t> pool(static_cast<size_t>(2 * total + 16));
    std::iota(pool.begin(), pool.end(), 0);
    for (size_t i = pool.size() - 1; i > 0; --i)
      std::swap(pool[i], pool[static_cast<size_t>(draw.uniform(0, static_cast<int64_t>(i)))]);
    size_t next = 0;
    for (int v = 0; v < n; ++v) {
      tree.add_node(parent[v], std::span<const int32_t>(pool.data() + next, static_cast<size_t>(len[v])));
      next += static_cast<size_t>(len[v]);
    }
  } else {
    for (int v = 0; v < n; ++v) tree.add_node(parent[v], len[v]);
  }

  for (int v = 0; v < n; ++v) {
    const bool leaf = num_children[v] == 0;
    if (leaf || draw.bernoulli(spec.internal_query_prob)) {
      const int64_t q = draw.uniform(1, spec.max_queries_per_leaf);
      for (int64_t i = 0; i < q; ++i) tree.add_query(v);
    }
  }
  if (spec.shuffle_queries) {
    auto& qs = tree.query_node;
    for (size_t i = qs.size(); i > 1; --i) std::swap(qs[i - 1], qs[static_cast<size_t>(draw.uniform(0, static_cast<int64_t>(i - 1)))]);
  }
  validate_tree(tree);
  return tree;
}

int64_t max_slot_plus_one(const KvTree& tree) {
  int64_t m = 0;
  for (int32_t s : tree.slots) m = std::max<int64_t>(m, static_cast<int64_t>(s) + 1);
  return m;
}

}  // namespace fasttree
