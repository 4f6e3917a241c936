// Tree generators (core/tree_gen.h): level trees, random forests, int lists.
#include "core/tree_gen.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"

namespace fasttree {
namespace {

void check_levels(const std::vector<int64_t>& counts, const std::vector<int64_t>& lens) {
  const KvTree t = tree_from_levels(counts, lens);
  EXPECT_NO_THROW(validate_tree(t));
  int64_t total = 0, tokens = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    total += counts[i];
    tokens += counts[i] * lens[i];
  }
  ASSERT_EQ(t.num_nodes(), total);
  EXPECT_EQ(t.num_tokens(), tokens);
  EXPECT_EQ(max_slot_plus_one(t), tokens);  // implicit consecutive slots
  int64_t first = 0, prev_first = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    for (int64_t j = 0; j < counts[i]; ++j) {
      const int v = static_cast<int>(first + j);
      EXPECT_EQ(t.node_len(v), lens[i]) << "level " << i << " node " << j;
      const int expected_parent = i == 0 ? -1 : static_cast<int>(prev_first + (j * counts[i - 1]) / counts[i]);
      EXPECT_EQ(t.parent[v], expected_parent) << "level " << i << " node " << j;
    }
    prev_first = first;
    first += counts[i];
  }
  // One query per node of the last level, in node order.
  ASSERT_EQ(t.num_queries(), counts.back());
  for (int q = 0; q < t.num_queries(); ++q) EXPECT_EQ(t.query_node[q], prev_first + q);
}

TEST(TreeGen, LevelsParentRule) {
  check_levels({1, 4, 16}, {100, 30, 10});
  check_levels({1, 10}, {5, 7});
  check_levels({1, 16, 64}, {1024, 256, 32});
  check_levels({1}, {9});
  check_levels({2, 3, 7}, {1, 0, 2});   // forest, an empty level
  check_levels({1, 8, 3}, {4, 4, 4});   // a level smaller than the previous one
}

TEST(TreeGen, LevelsBalancedFanout) {
  // 1,16,64: every level-1 node gets exactly 4 children, the children of a node are contiguous.
  const KvTree t = tree_from_levels(std::vector<int64_t>{1, 16, 64}, std::vector<int64_t>{1024, 256, 32});
  TreeTopology topo;
  topo.build(t);
  EXPECT_EQ(topo.num_children(0), 16);
  for (int v = 1; v <= 16; ++v) {
    ASSERT_EQ(topo.num_children(v), 4);
    EXPECT_EQ(topo.children[topo.child_begin[v]], 17 + 4 * (v - 1));
  }
  EXPECT_EQ(t.parent[17], 1);
  EXPECT_EQ(t.parent[20], 1);
  EXPECT_EQ(t.parent[21], 2);
  EXPECT_EQ(t.parent[80], 16);
  // 1,10: a star.
  const KvTree s = tree_from_levels(std::vector<int64_t>{1, 10}, std::vector<int64_t>{50, 5});
  for (int v = 1; v <= 10; ++v) EXPECT_EQ(s.parent[v], 0);
  // 1,4,16 explicitly.
  const KvTree u = tree_from_levels(std::vector<int64_t>{1, 4, 16}, std::vector<int64_t>{1, 1, 1});
  const std::vector<int32_t> expected = {-1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4};
  EXPECT_EQ(u.parent, expected);
}

TEST(TreeGen, LevelsErrors) {
  using V = std::vector<int64_t>;
  EXPECT_THROW(tree_from_levels(V{1, 2}, V{3}), Error);
  EXPECT_THROW(tree_from_levels(V{}, V{}), Error);
  EXPECT_THROW(tree_from_levels(V{1, 0, 2}, V{1, 1, 1}), Error);
  EXPECT_THROW(tree_from_levels(V{1, 2}, V{1, -1}), Error);
  EXPECT_THROW(tree_from_levels(V{1, 100000}, V{1, 100000}), Error);  // > 2^31 tokens
  try {
    tree_from_levels(V{1, 0}, V{1, 1});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("level 1"), std::string::npos) << e.message();
  }
  try {
    tree_from_levels(V{1, 2, 3}, V{1, 2});
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("3 node counts but 2 lengths"), std::string::npos) << e.message();
  }
}

TEST(TreeGen, RandomForestsValidAndVaried) {
  int with_internal_query = 0, with_empty_node = 0, forests = 0, deep = 0;
  for (uint64_t seed = 0; seed < 500; ++seed) {
    RandomForestSpec spec;
    spec.explicit_slots = seed % 2 == 1;
    spec.shuffle_queries = seed % 4 == 3;
    const KvTree t = random_forest(spec, seed);
    ASSERT_NO_THROW(validate_tree(t, max_slot_plus_one(t))) << seed;
    TreeTopology topo;
    topo.build(t);
    ASSERT_GE(static_cast<int>(topo.roots.size()), spec.min_roots);
    ASSERT_LE(static_cast<int>(topo.roots.size()), spec.max_roots);
    forests += topo.roots.size() > 1;
    const TreeStats st = tree_stats(t, topo);
    ASSERT_LE(st.max_depth, spec.max_depth);
    deep += st.max_depth == spec.max_depth;
    for (int v = 0; v < t.num_nodes(); ++v) {
      const int own = topo.query_begin[v + 1] - topo.query_begin[v];
      ASSERT_LE(t.node_len(v), spec.max_len);
      ASSERT_LE(own, spec.max_queries_per_leaf);
      ASSERT_LE(topo.num_children(v), spec.max_fanout);
      if (topo.num_children(v) == 0) ASSERT_GE(own, 1) << "leaf without query, seed " << seed;
      else if (own > 0) ++with_internal_query;
      if (t.node_len(v) == 0) ++with_empty_node;
    }
    if (spec.explicit_slots) {
      std::set<int32_t> unique(t.slots.begin(), t.slots.end());
      ASSERT_EQ(unique.size(), t.slots.size()) << seed;  // unique across the whole forest
      ASSERT_LE(max_slot_plus_one(t), 2 * t.num_tokens() + 16);
    } else {
      for (int64_t i = 0; i < t.num_tokens(); ++i) ASSERT_EQ(t.slots[i], i);
    }
    if (!spec.shuffle_queries) ASSERT_TRUE(std::is_sorted(t.query_node.begin(), t.query_node.end()));
  }
  EXPECT_GT(with_internal_query, 50);
  EXPECT_GT(with_empty_node, 50);
  EXPECT_GT(forests, 100);
  EXPECT_GT(deep, 50);
}

TEST(TreeGen, RandomForestDeterministic) {
  RandomForestSpec spec;
  spec.explicit_slots = true;
  spec.shuffle_queries = true;
  for (uint64_t seed : {0ull, 1ull, 12345ull, ~0ull}) {
    const KvTree a = random_forest(spec, seed);
    const KvTree b = random_forest(spec, seed);
    EXPECT_EQ(a.parent, b.parent);
    EXPECT_EQ(a.slot_begin, b.slot_begin);
    EXPECT_EQ(a.slots, b.slots);
    EXPECT_EQ(a.query_node, b.query_node);
  }
  const KvTree x = random_forest(spec, 1), y = random_forest(spec, 2);
  EXPECT_TRUE(x.parent != y.parent || x.slots != y.slots || x.query_node != y.query_node);
}

TEST(TreeGen, RandomForestSpecs) {
  RandomForestSpec single;
  single.min_roots = single.max_roots = 1;
  single.max_depth = 1;
  single.empty_node_prob = 0;
  single.min_len = 5;
  single.max_len = 5;
  const KvTree one = random_forest(single, 3);
  EXPECT_EQ(one.num_nodes(), 1);
  EXPECT_EQ(one.node_len(0), 5);
  EXPECT_GE(one.num_queries(), 1);

  RandomForestSpec chain;
  chain.min_roots = chain.max_roots = 2;
  chain.max_fanout = 1;
  chain.max_depth = 3;
  chain.internal_query_prob = 1.0;
  const KvTree c = random_forest(chain, 5);
  TreeTopology topo;
  topo.build(c);
  for (int v = 0; v < c.num_nodes(); ++v) EXPECT_GE(topo.query_begin[v + 1] - topo.query_begin[v], 1);

  RandomForestSpec bad;
  bad.min_roots = 0;
  EXPECT_THROW(random_forest(bad, 0), Error);
  bad = {};
  bad.max_len = -1;
  EXPECT_THROW(random_forest(bad, 0), Error);
  bad = {};
  bad.empty_node_prob = 1.5;
  EXPECT_THROW(random_forest(bad, 0), Error);
  bad = {};
  bad.max_queries_per_leaf = 0;
  EXPECT_THROW(random_forest(bad, 0), Error);
}

TEST(TreeGen, MaxSlotPlusOne) {
  KvTree t;
  EXPECT_EQ(max_slot_plus_one(t), 0);
  t.add_node(-1, 0);
  EXPECT_EQ(max_slot_plus_one(t), 0);
  const std::vector<int32_t> s = {9, 3};
  t.add_node(0, s);
  EXPECT_EQ(max_slot_plus_one(t), 10);
}

TEST(TreeGen, ParseIntList) {
  EXPECT_EQ(parse_int_list("1,16,64", "--levels"), (std::vector<int64_t>{1, 16, 64}));
  EXPECT_EQ(parse_int_list("7", "x"), (std::vector<int64_t>{7}));
  EXPECT_EQ(parse_int_list(" 1 , 0,2 ", "x"), (std::vector<int64_t>{1, 0, 2}));
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "item 0 of '' is empty"},
      {"1,,2", "item 1 of '1,,2' is empty"},
      {"1,2,", "item 2 of '1,2,' is empty"},
      {",1", "item 0"},
      {"1,a", "('a') is not a number"},
      {"1,2x", "('2x') is not a number"},
      {"1.5", "not a number"},
      {"+3", "not a number"},
      {"4,-3", "item 1 of '4,-3' is negative (-3)"},
      {"99999999999999999999", "too large"},
  };
  for (const auto& [text, frag] : bad) {
    try {
      parse_int_list(text, "--lens");
      ADD_FAILURE() << text;
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("--lens: "), std::string::npos) << e.message();
      EXPECT_NE(e.message().find(frag), std::string::npos) << text << ": " << e.message();
    }
  }
}

}  // namespace
}  // namespace fasttree
