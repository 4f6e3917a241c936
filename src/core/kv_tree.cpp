#include "core/kv_tree.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace fasttree {

int KvTree::add_node(int parent_id, int64_t len) {
  FT_CHECK(len >= 0, "node " + std::to_string(num_nodes()) + ": negative length " + std::to_string(len));
  const int32_t first = slots.empty() ? 0 : slots.back() + 1;
  for (int64_t i = 0; i < len; ++i) slots.push_back(static_cast<int32_t>(first + i));
  parent.push_back(parent_id);
  slot_begin.push_back(static_cast<int64_t>(slots.size()));
  return num_nodes() - 1;
}

int KvTree::add_node(int parent_id, std::span<const int32_t> node_slot_list) {
  slots.insert(slots.end(), node_slot_list.begin(), node_slot_list.end());
  parent.push_back(parent_id);
  slot_begin.push_back(static_cast<int64_t>(slots.size()));
  return num_nodes() - 1;
}

void KvTree::clear() {
  parent.clear();
  slot_begin.assign(1, 0);
  slots.clear();
  query_node.clear();
}

namespace {

std::string node_name(int i) { return "node " + std::to_string(i); }

// Detects parent cycles: every node must reach a root by following parents.
void check_acyclic(const KvTree& tree) {
  const int n = tree.num_nodes();
  std::vector<uint8_t> state(n, 0);  // 0 unseen, 1 on the current walk, 2 reaches a root
  std::vector<int> walk;
  for (int start = 0; start < n; ++start) {
    int v = start;
    walk.clear();
    while (v >= 0 && state[v] == 0) {
      state[v] = 1;
      walk.push_back(v);
      v = tree.parent[v];
    }
    if (v >= 0 && state[v] == 1)
      FT_FAIL(node_name(v) + ": parent cycle (node " + std::to_string(v) + " is its own ancestor)");
    for (int w : walk) state[w] = 2;
  }
}

}  // namespace

void validate_tree(const KvTree& tree, int64_t num_slots) {
  const int n = tree.num_nodes();
  FT_CHECK(tree.slot_begin.size() == static_cast<size_t>(n) + 1 && tree.slot_begin[0] == 0 &&
               tree.slot_begin[n] == tree.num_tokens(),
           "tree slot table is inconsistent with its " + std::to_string(n) + " nodes");
  for (int i = 0; i < n; ++i) {
    FT_CHECK(tree.slot_begin[i + 1] >= tree.slot_begin[i], node_name(i) + ": negative length");
    const int p = tree.parent[i];
    FT_CHECK(p >= -1 && p < n, node_name(i) + ": parent " + std::to_string(p) + " out of range [-1, " +
                                   std::to_string(n) + ")");
    FT_CHECK(p != i, node_name(i) + ": is its own parent");
  }
  check_acyclic(tree);
  for (int q = 0; q < tree.num_queries(); ++q) {
    const int v = tree.query_node[q];
    FT_CHECK(v >= 0 && v < n, "query " + std::to_string(q) + ": sits at missing node " + std::to_string(v) +
                                  " (tree has " + std::to_string(n) + " nodes)");
  }
  int32_t max_slot = -1;
  for (int i = 0; i < n; ++i) {
    for (int32_t s : tree.node_slots(i)) {
      FT_CHECK(s >= 0, node_name(i) + ": negative slot " + std::to_string(s));
      FT_CHECK(num_slots < 0 || s < num_slots, node_name(i) + ": slot " + std::to_string(s) +
                                                   " out of range [0, " + std::to_string(num_slots) + ")");
      max_slot = std::max(max_slot, s);
    }
  }
  // A slot may appear in several branches, but only once on any root -> node path.
  TreeTopology topo;
  topo.build(tree);
  std::vector<uint8_t> on_path(static_cast<size_t>(max_slot) + 1, 0);
  std::vector<std::pair<int, int>> stack;  // (node, next child index)
  auto enter = [&](int v) {
    for (int32_t s : tree.node_slots(v)) {
      if (on_path[s]) FT_FAIL(node_name(v) + ": slot " + std::to_string(s) + " is used twice on the path to it");
      on_path[s] = 1;
    }
    stack.emplace_back(v, topo.child_begin[v]);
  };
  for (int r : topo.roots) {
    enter(r);
    while (!stack.empty()) {
      auto& [v, next] = stack.back();
      if (next < topo.child_begin[v + 1]) {
        enter(topo.children[next++]);
      } else {
        for (int32_t s : tree.node_slots(v)) on_path[s] = 0;
        stack.pop_back();
      }
    }
  }
}

void TreeTopology::build(const KvTree& tree) {
  const int n = tree.num_nodes();
  roots.clear();
  child_begin.assign(n + 1, 0);
  for (int i = 0; i < n; ++i) {
    if (tree.parent[i] < 0) roots.push_back(i);
    else ++child_begin[tree.parent[i] + 1];
  }
  for (int i = 0; i < n; ++i) child_begin[i + 1] += child_begin[i];
  children.resize(child_begin[n]);
  // Fill in node order using path_len as a temporary cursor buffer.
  path_len.assign(n, 0);
  for (int i = 0; i < n; ++i) {
    const int p = tree.parent[i];
    if (p >= 0) children[child_begin[p] + path_len[p]++] = i;
  }
  bfs_order.clear();
  bfs_order.insert(bfs_order.end(), roots.begin(), roots.end());
  for (size_t h = 0; h < bfs_order.size(); ++h) {
    const int v = bfs_order[h];
    for (int c = child_begin[v]; c < child_begin[v + 1]; ++c) bfs_order.push_back(children[c]);
  }
  for (int v : bfs_order) {
    const int p = tree.parent[v];
    path_len[v] = tree.node_len(v) + (p >= 0 ? path_len[p] : 0);
  }
  const int nq = tree.num_queries();
  query_begin.assign(n + 1, 0);
  for (int q = 0; q < nq; ++q) ++query_begin[tree.query_node[q] + 1];
  for (int i = 0; i < n; ++i) query_begin[i + 1] += query_begin[i];
  node_queries.resize(nq);
  subtree_queries.assign(n, 0);  // temporary cursor
  for (int q = 0; q < nq; ++q) {
    const int v = tree.query_node[q];
    node_queries[query_begin[v] + subtree_queries[v]++] = q;
  }
  for (int h = n - 1; h >= 0; --h) {  // children after parents in bfs order
    const int v = bfs_order[h];
    const int p = tree.parent[v];
    if (p >= 0) subtree_queries[p] += subtree_queries[v];
  }
}

TreeStats tree_stats(const KvTree& tree, const TreeTopology& topo) {
  TreeStats s;
  std::vector<int> depth(tree.num_nodes(), 0);
  for (int v : topo.bfs_order) {
    const int p = tree.parent[v];
    depth[v] = p >= 0 ? depth[p] + 1 : 1;
    s.max_depth = std::max(s.max_depth, depth[v]);
    if (topo.subtree_queries[v] > 0) s.unique_tokens += tree.node_len(v);
  }
  for (int q = 0; q < tree.num_queries(); ++q) s.sum_path_len += topo.path_len[tree.query_node[q]];
  return s;
}

}  // namespace fasttree
