// RadixCache: radix-tree prefix cache over token IDs whose nodes own KV slots from a SlotPool,
// modelled on SGLang's RadixCache (match_prefix / insert / lock / evict; page size 1).
//
// Every non-root node holds a non-empty run of tokens (`key`) and the KV slot of each of them;
// the tokens of a node's path from the root form a cached prefix. Children are keyed by their first
// token. As in SGLang, chains are never merged back: a node may have a single child (after a split
// or an eviction), which keeps node handles held by requests stable.
//
// Node handles (NodeId) are indices into a node table with a free list. A handle stays valid, and
// keeps naming the same token path, until its node is evicted (only possible while unlocked) or
// the cache is reset; splits create a new node for the *upper* part and leave the handle on the
// lower part. Ids of evicted nodes are recycled.
//
// Typical engine use (what SGLang's scheduler does):
//   m = cache.match_prefix(prompt); cache.lock(m.node);          // reuse m.slots, pin them
//   tail = pool.alloc(prompt.size() - m.length); ... prefill ...
//   r = cache.insert(tokens, m.slots ++ tail);                   // cache adopts slots[r.cached_prefix..)
//   pool.free(tail[0 .. r.cached_prefix - m.length));            // duplicates of what got cached
//   cache.lock(r.node); cache.unlock(m.node);
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/slot_pool.h"

namespace fasttree {

using NodeId = int32_t;
inline constexpr NodeId kRootNode = 0;
inline constexpr NodeId kNoNode = -1;

class RadixCache {
 public:
  struct MatchResult {
    NodeId node = kRootNode;      // node whose path is exactly the matched prefix (root if none)
    int64_t length = 0;           // matched tokens
    std::vector<int32_t> slots;   // [length] KV slots of the matched prefix, in token order
  };
  struct InsertResult {
    int64_t cached_prefix = 0;    // tokens that were already cached before this insert
    NodeId node = kRootNode;      // node whose path is exactly the inserted sequence
  };

  // The pool must outlive the cache; the cache frees evicted slots into it.
  explicit RadixCache(SlotPool& pool);
  RadixCache(const RadixCache&) = delete;
  RadixCache& operator=(const RadixCache&) = delete;

  // Longest cached prefix of `tokens`. If it ends inside a node, that node is split so that the
  // returned node ends exactly there. Marks the path as used now (LRU).
  MatchResult match_prefix(std::span<const int32_t> tokens);

  // Caches `tokens` with their KV `slots` (same size), splitting nodes as needed, and marks the path
  // as used now. Returns the length of the prefix that was already cached and the node ending at
  // the last token. Ownership (as in SGLang): the cache adopts slots[cached_prefix..); it does NOT
  // take slots[0..cached_prefix). For those positions the cached slot wins: where the caller's
  // slot differs from it (the caller computed a duplicate), the caller must free it. Slots obtained
  // from match_prefix are the cache's own and must not be freed. Every slot must be in use in the
  // pool; nothing changes when a check fails.
  InsertResult insert(std::span<const int32_t> tokens, std::span<const int32_t> slots);

  // Pins / unpins a node and all its ancestors (reference counts). Locked nodes are never evicted.
  // lock/unlock of the root are no-ops; unlocking a node that is not locked throws.
  void lock(NodeId node);
  void unlock(NodeId node);

  // Evicts unlocked leaves, least recently used first (ties: lower id first), returning their slots
  // to the pool, until at least `num_tokens` slots were freed or nothing is evictable. Parents that
  // become unlocked leaves are candidates too. Returns the number of slots freed (whole nodes are
  // evicted, so it may exceed num_tokens). O(nodes + evicted·log nodes).
  int64_t evict(int64_t num_tokens);

  // Frees every cached slot into the pool and empties the tree. Throws if any node is locked.
  void reset();

  int64_t total_tokens() const { return locked_tokens_ + evictable_tokens_; }
  int64_t locked_tokens() const { return locked_tokens_; }       // tokens in nodes with lock_ref > 0
  int64_t evictable_tokens() const { return evictable_tokens_; } // tokens in unlocked nodes
  int32_t num_nodes() const { return num_live_; }                 // live nodes, root included
  const SlotPool& pool() const { return pool_; }

  // Node inspection (for build_kv_tree, tests, tools). All but is_valid throw on a bad handle.
  NodeId node_id_bound() const { return static_cast<NodeId>(nodes_.size()); }  // ids are < this
  bool is_valid(NodeId node) const;
  NodeId node_parent(NodeId node) const;  // kNoNode for the root
  std::span<const int32_t> node_key(NodeId node) const;
  std::span<const int32_t> node_slots(NodeId node) const;
  int32_t node_lock_ref(NodeId node) const;
  uint64_t node_last_access(NodeId node) const;
  int32_t node_num_children(NodeId node) const;
  NodeId node_child(NodeId node, int32_t first_token) const;  // kNoNode when absent
  int64_t node_depth_tokens(NodeId node) const;               // tokens on root -> node

  // Throws fasttree::Error describing the first violated structural invariant: reachability of
  // every live node, non-empty keys, key/slot sizes, children sorted and keyed by first token,
  // parent links, lock_ref(v) >= Σ lock_ref(children) >= 0, token counters, and every cached slot
  // in use in the pool and cached once.
  void check_invariants() const;
  // Human-readable tree, one node per line (ids, lengths, first tokens, lock refs, access ticks).
  std::string dump() const;

 private:
  struct Child {
    int32_t token;  // first token of the child's key
    NodeId id;
  };
  struct Node {
    std::vector<int32_t> key;
    std::vector<int32_t> slots;
    std::vector<Child> children;  // sorted by token
    NodeId parent = kNoNode;
    int32_t lock_ref = 0;
    uint64_t last_access = 0;
    bool live = false;
  };

  const Node& get(NodeId node, const char* what) const;
  NodeId new_node();
  void delete_node(NodeId node);
  std::vector<Child>::iterator find_child(Node& parent, int32_t token);
  NodeId child_of(NodeId parent, int32_t token) const;
  void replace_child(NodeId parent, int32_t token, NodeId child);
  void add_child(NodeId parent, NodeId child);
  // Splits `node` after `len` tokens (0 < len < key size); returns the new upper node.
  NodeId split(NodeId node, int64_t len);

  SlotPool& pool_;
  std::vector<Node> nodes_;
  std::vector<NodeId> free_ids_;
  int32_t num_live_ = 0;
  int64_t locked_tokens_ = 0;
  int64_t evictable_tokens_ = 0;
  uint64_t clock_ = 0;
};

}  // namespace fasttree
