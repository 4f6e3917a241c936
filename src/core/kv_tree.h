// KvTree: a forest of context nodes, each owning an ordered list of KV-pool slots (its tokens),
// plus decode queries that sit at nodes. A query's context is the concatenation of the slots on
// the path root -> node. See DESIGN.md §2.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace fasttree {

struct KvTree {
  std::vector<int32_t> parent;      // [num_nodes]; -1 marks a root (forests allowed)
  std::vector<int64_t> slot_begin;  // [num_nodes + 1]; node i owns slots[slot_begin[i], slot_begin[i+1])
  std::vector<int32_t> slots;       // [num_tokens]; KV-pool slot of every stored token
  std::vector<int32_t> query_node;  // [num_queries]; node each decode query sits at

  KvTree() : slot_begin{0} {}

  int num_nodes() const { return static_cast<int>(parent.size()); }
  int num_queries() const { return static_cast<int>(query_node.size()); }
  int64_t num_tokens() const { return static_cast<int64_t>(slots.size()); }
  int64_t node_len(int node) const { return slot_begin[node + 1] - slot_begin[node]; }
  std::span<const int32_t> node_slots(int node) const {
    return {slots.data() + slot_begin[node], static_cast<size_t>(node_len(node))};
  }

  // Appends a node whose `len` tokens occupy consecutive slots right after the last slot stored so
  // far (slot 0 for the first). Returns its id. Parents are not checked here (see validate_tree).
  int add_node(int parent_id, int64_t len);
  // Appends a node with an explicit slot list.
  int add_node(int parent_id, std::span<const int32_t> node_slot_list);
  void add_query(int node) { query_node.push_back(node); }
  void clear();
};

// Throws fasttree::Error naming the offending node or query when the tree is malformed: parent out
// of range, a cycle, a query at a missing node, a negative slot, a slot >= num_slots (when
// num_slots >= 0), or a slot used twice on one root->node path.
void validate_tree(const KvTree& tree, int64_t num_slots = -1);

// Derived structure of a (valid) tree, rebuilt into existing buffers without reallocating once
// they are large enough.
struct TreeTopology {
  std::vector<int32_t> roots;            // root ids in node order
  std::vector<int32_t> child_begin;      // [n+1] CSR into children
  std::vector<int32_t> children;         // children of each node, in node order
  std::vector<int32_t> bfs_order;        // every node, parents before children
  std::vector<int64_t> path_len;         // [n] tokens on root -> node, inclusive
  std::vector<int32_t> query_begin;      // [n+1] CSR into node_queries
  std::vector<int32_t> node_queries;     // queries at each node, in query order
  std::vector<int32_t> subtree_queries;  // [n] queries in the node's subtree (itself included)

  void build(const KvTree& tree);  // tree must be valid
  int num_children(int node) const { return child_begin[node + 1] - child_begin[node]; }
};

// Figures of a tree used by the floors of DESIGN.md §6.
struct TreeStats {
  int64_t unique_tokens = 0;  // tokens stored in nodes that some query reads
  int64_t sum_path_len = 0;   // Σ over queries of the query's context length
  int max_depth = 0;
};
TreeStats tree_stats(const KvTree& tree, const TreeTopology& topo);

}  // namespace fasttree
