// RadixCache implementation (see radix_cache.h for semantics and ownership rules).
#include "core/radix_cache.h"

#include <algorithm>
#include <functional>
#include <utility>

#include "core/error.h"

namespace fasttree {

namespace {

std::string id_str(NodeId id) { return "node " + std::to_string(id); }

// Number of leading positions where a and b agree.
size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

// "[a b c ...]" with at most `limit` entries.
std::string list_str(std::span<const int32_t> v, size_t limit = 8) {
  std::string s = "[";
  for (size_t i = 0; i < v.size() && i < limit; ++i) {
    if (i) s += ' ';
    s += std::to_string(v[i]);
  }
  if (v.size() > limit) s += " ...";
  return s + "]";
}

}  // namespace

RadixCache::RadixCache(SlotPool& pool) : pool_(pool) { new_node(); }  // root = kRootNode

// ---- node table ---------------------------------------------------------------------------------

bool RadixCache::is_valid(NodeId node) const {
  return node >= 0 && node < node_id_bound() && nodes_[node].live;
}

const RadixCache::Node& RadixCache::get(NodeId node, const char* what) const {
  FT_CHECK(is_valid(node), std::string("RadixCache::") + what + ": invalid node handle " + std::to_string(node) +
                               " (evicted, never created, or out of range [0, " +
                               std::to_string(node_id_bound()) + "))");
  return nodes_[node];
}

NodeId RadixCache::new_node() {
  NodeId id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = node_id_bound();
    nodes_.emplace_back();
  }
  Node& n = nodes_[id];
  n.key.clear();
  n.slots.clear();
  n.children.clear();
  n.parent = kNoNode;
  n.lock_ref = 0;
  n.last_access = clock_;
  n.live = true;
  ++num_live_;
  return id;
}

void RadixCache::delete_node(NodeId node) {
  Node& n = nodes_[node];
  n = Node{};  // releases the node's buffers; live = false
  free_ids_.push_back(node);
  --num_live_;
}

std::vector<RadixCache::Child>::iterator RadixCache::find_child(Node& parent, int32_t token) {
  auto it = std::lower_bound(parent.children.begin(), parent.children.end(), token,
                             [](const Child& c, int32_t t) { return c.token < t; });
  return (it != parent.children.end() && it->token == token) ? it : parent.children.end();
}

NodeId RadixCache::child_of(NodeId parent, int32_t token) const {
  const auto& ch = nodes_[parent].children;
  auto it = std::lower_bound(ch.begin(), ch.end(), token, [](const Child& c, int32_t t) { return c.token < t; });
  return (it != ch.end() && it->token == token) ? it->id : kNoNode;
}

void RadixCache::replace_child(NodeId parent, int32_t token, NodeId child) {
  auto it = find_child(nodes_[parent], token);
  it->id = child;
}

void RadixCache::add_child(NodeId parent, NodeId child) {
  auto& ch = nodes_[parent].children;
  const int32_t token = nodes_[child].key.front();
  auto it = std::lower_bound(ch.begin(), ch.end(), token, [](const Child& c, int32_t t) { return c.token < t; });
  ch.insert(it, Child{token, child});
}

NodeId RadixCache::split(NodeId node, int64_t len) {
  const NodeId up = new_node();  // may reallocate nodes_: take references afterwards
  Node& lo = nodes_[node];
  Node& u = nodes_[up];
  u.key.assign(lo.key.begin(), lo.key.begin() + len);
  u.slots.assign(lo.slots.begin(), lo.slots.begin() + len);
  lo.key.erase(lo.key.begin(), lo.key.begin() + len);
  lo.slots.erase(lo.slots.begin(), lo.slots.begin() + len);
  u.parent = lo.parent;
  u.lock_ref = lo.lock_ref;  // same set of locked descendants
  u.last_access = lo.last_access;
  u.children.push_back(Child{lo.key.front(), node});
  lo.parent = up;
  replace_child(u.parent, u.key.front(), up);
  return up;
}

// ---- operations ---------------------------------------------------------------------------------

RadixCache::MatchResult RadixCache::match_prefix(std::span<const int32_t> tokens) {
  MatchResult r;
  const uint64_t tick = ++clock_;
  nodes_[kRootNode].last_access = tick;
  NodeId v = kRootNode;
  size_t pos = 0;
  while (pos < tokens.size()) {
    NodeId c = child_of(v, tokens[pos]);
    if (c == kNoNode) break;
    const size_t key_len = nodes_[c].key.size();
    const size_t m = common_prefix(nodes_[c].key, tokens.subspan(pos));
    nodes_[c].last_access = tick;
    if (m < key_len) c = split(c, static_cast<int64_t>(m));
    const auto& s = nodes_[c].slots;
    r.slots.insert(r.slots.end(), s.begin(), s.end());
    pos += m;
    v = c;
    if (m < key_len) break;
  }
  r.node = v;
  r.length = static_cast<int64_t>(pos);
  return r;
}

RadixCache::InsertResult RadixCache::insert(std::span<const int32_t> tokens, std::span<const int32_t> slots) {
  FT_CHECK(tokens.size() == slots.size(), "RadixCache::insert: " + std::to_string(tokens.size()) + " tokens but " +
                                              std::to_string(slots.size()) + " slots");
  for (size_t i = 0; i < slots.size(); ++i)
    FT_CHECK(pool_.is_in_use(slots[i]), "RadixCache::insert: slot " + std::to_string(slots[i]) + " at position " +
                                            std::to_string(i) + " is not an allocated slot of the pool (capacity " +
                                            std::to_string(pool_.capacity()) + ")");
  const uint64_t tick = ++clock_;
  nodes_[kRootNode].last_access = tick;
  NodeId v = kRootNode;
  size_t pos = 0;
  size_t cached = 0;
  while (pos < tokens.size()) {
    NodeId c = child_of(v, tokens[pos]);
    if (c == kNoNode) {
      cached = pos;
      const NodeId leaf = new_node();
      Node& l = nodes_[leaf];
      l.key.assign(tokens.begin() + pos, tokens.end());
      l.slots.assign(slots.begin() + pos, slots.end());
      l.parent = v;
      l.last_access = tick;
      add_child(v, leaf);
      evictable_tokens_ += static_cast<int64_t>(tokens.size() - pos);
      v = leaf;
      pos = tokens.size();
      break;
    }
    const size_t m = common_prefix(nodes_[c].key, tokens.subspan(pos));
    nodes_[c].last_access = tick;
    if (m < nodes_[c].key.size()) c = split(c, static_cast<int64_t>(m));
    pos += m;
    cached = pos;
    v = c;
  }
  return InsertResult{static_cast<int64_t>(cached), v};
}

void RadixCache::lock(NodeId node) {
  get(node, "lock");
  for (NodeId v = node; v != kRootNode; v = nodes_[v].parent) {
    Node& n = nodes_[v];
    if (n.lock_ref++ == 0) {
      evictable_tokens_ -= static_cast<int64_t>(n.key.size());
      locked_tokens_ += static_cast<int64_t>(n.key.size());
    }
  }
}

void RadixCache::unlock(NodeId node) {
  const Node& target = get(node, "unlock");
  if (node == kRootNode) return;
  FT_CHECK(target.lock_ref > 0, "RadixCache::unlock: " + id_str(node) + " is not locked (unlock without lock)");
  // Ancestors hold lock_ref >= this node's (invariant), so none can go below zero.
  for (NodeId v = node; v != kRootNode; v = nodes_[v].parent) {
    Node& n = nodes_[v];
    if (--n.lock_ref == 0) {
      locked_tokens_ -= static_cast<int64_t>(n.key.size());
      evictable_tokens_ += static_cast<int64_t>(n.key.size());
    }
  }
}

int64_t RadixCache::evict(int64_t num_tokens) {
  FT_CHECK(num_tokens >= 0, "RadixCache::evict: negative token count " + std::to_string(num_tokens));
  if (num_tokens == 0) return 0;
  using Entry = std::pair<uint64_t, NodeId>;  // (last_access, id): min-heap, oldest first
  std::vector<Entry> heap;
  for (NodeId id = 1; id < node_id_bound(); ++id) {
    const Node& n = nodes_[id];
    if (n.live && n.children.empty() && n.lock_ref == 0) heap.emplace_back(n.last_access, id);
  }
  std::make_heap(heap.begin(), heap.end(), std::greater<>());
  int64_t freed = 0;
  while (freed < num_tokens && !heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>());
    const NodeId v = heap.back().second;
    heap.pop_back();
    Node& n = nodes_[v];
    pool_.free(n.slots);
    const auto len = static_cast<int64_t>(n.key.size());
    freed += len;
    evictable_tokens_ -= len;
    const NodeId p = n.parent;
    Node& pn = nodes_[p];
    pn.children.erase(find_child(pn, n.key.front()));
    delete_node(v);
    if (p != kRootNode && pn.children.empty() && pn.lock_ref == 0) {
      heap.emplace_back(pn.last_access, p);
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  }
  return freed;
}

void RadixCache::reset() {
  FT_CHECK(locked_tokens_ == 0, "RadixCache::reset: " + std::to_string(locked_tokens_) +
                                    " tokens are still locked by live requests");
  for (NodeId id = 1; id < node_id_bound(); ++id)
    if (nodes_[id].live) pool_.free(nodes_[id].slots);
  nodes_.clear();
  free_ids_.clear();
  num_live_ = 0;
  locked_tokens_ = 0;
  evictable_tokens_ = 0;
  new_node();
}

// ---- inspection ---------------------------------------------------------------------------------

NodeId RadixCache::node_parent(NodeId node) const { return get(node, "node_parent").parent; }
std::span<const int32_t> RadixCache::node_key(NodeId node) const { return get(node, "node_key").key; }
std::span<const int32_t> RadixCache::node_slots(NodeId node) const { return get(node, "node_slots").slots; }
int32_t RadixCache::node_lock_ref(NodeId node) const { return get(node, "node_lock_ref").lock_ref; }
uint64_t RadixCache::node_last_access(NodeId node) const { return get(node, "node_last_access").last_access; }
int32_t RadixCache::node_num_children(NodeId node) const {
  return static_cast<int32_t>(get(node, "node_num_children").children.size());
}
NodeId RadixCache::node_child(NodeId node, int32_t first_token) const {
  get(node, "node_child");
  return child_of(node, first_token);
}
int64_t RadixCache::node_depth_tokens(NodeId node) const {
  get(node, "node_depth_tokens");
  int64_t len = 0;
  for (NodeId v = node; v != kNoNode; v = nodes_[v].parent) len += static_cast<int64_t>(nodes_[v].key.size());
  return len;
}

void RadixCache::check_invariants() const {
  FT_CHECK(is_valid(kRootNode), "radix invariant: root is missing");
  const Node& root = nodes_[kRootNode];
  FT_CHECK(root.key.empty() && root.slots.empty() && root.parent == kNoNode,
           "radix invariant: root must have an empty key, no slots and no parent");
  std::vector<uint8_t> visited(nodes_.size(), 0);
  std::vector<uint8_t> slot_seen(static_cast<size_t>(pool_.capacity()), 0);
  std::vector<NodeId> stack{kRootNode};
  visited[kRootNode] = 1;
  int32_t reached = 1;
  int64_t locked = 0, evictable = 0;
  while (!stack.empty()) {
    const NodeId v = stack.back();
    stack.pop_back();
    const Node& n = nodes_[v];
    FT_CHECK(n.lock_ref >= 0, "radix invariant: " + id_str(v) + " has negative lock_ref " + std::to_string(n.lock_ref));
    int64_t child_locks = 0;
    for (size_t i = 0; i < n.children.size(); ++i) {
      const Child& e = n.children[i];
      const std::string where = "radix invariant: child " + std::to_string(e.id) + " of " + id_str(v);
      FT_CHECK(i == 0 || n.children[i - 1].token < e.token, where + ": children not sorted by distinct first token");
      FT_CHECK(is_valid(e.id) && e.id != kRootNode, where + ": not a live node");
      FT_CHECK(!visited[e.id], where + ": reached twice (cycle or shared child)");
      visited[e.id] = 1;
      ++reached;
      const Node& c = nodes_[e.id];
      FT_CHECK(c.parent == v, where + ": parent link is " + std::to_string(c.parent));
      FT_CHECK(!c.key.empty(), where + ": empty key");
      FT_CHECK(c.key.front() == e.token, where + ": keyed by token " + std::to_string(e.token) + " but key starts with " +
                                             std::to_string(c.key.front()));
      FT_CHECK(c.key.size() == c.slots.size(), where + ": " + std::to_string(c.key.size()) + " tokens but " +
                                                   std::to_string(c.slots.size()) + " slots");
      for (int32_t s : c.slots) {
        FT_CHECK(pool_.is_in_use(s), where + ": cached slot " + std::to_string(s) + " is not in use in the pool");
        FT_CHECK(!slot_seen[s], where + ": slot " + std::to_string(s) + " is cached twice");
        slot_seen[s] = 1;
      }
      (c.lock_ref > 0 ? locked : evictable) += static_cast<int64_t>(c.key.size());
      child_locks += c.lock_ref;
      stack.push_back(e.id);
    }
    FT_CHECK(v == kRootNode || child_locks <= n.lock_ref,
             "radix invariant: " + id_str(v) + " has lock_ref " + std::to_string(n.lock_ref) +
                 " below its children's total " + std::to_string(child_locks));
  }
  FT_CHECK(reached == num_live_, "radix invariant: " + std::to_string(reached) + " nodes reachable but " +
                                     std::to_string(num_live_) + " live");
  FT_CHECK(static_cast<size_t>(num_live_) + free_ids_.size() == nodes_.size(),
           "radix invariant: node table size does not match live nodes + free ids");
  FT_CHECK(locked == locked_tokens_ && evictable == evictable_tokens_,
           "radix invariant: token counters locked/evictable = " + std::to_string(locked_tokens_) + "/" +
               std::to_string(evictable_tokens_) + " but the tree holds " + std::to_string(locked) + "/" +
               std::to_string(evictable));
}

std::string RadixCache::dump() const {
  std::string out = "radix cache: " + std::to_string(num_live_) + " nodes, " + std::to_string(total_tokens()) +
                    " tokens (" + std::to_string(locked_tokens_) + " locked, " + std::to_string(evictable_tokens_) +
                    " evictable)\n";
  std::vector<std::pair<NodeId, int>> stack{{kRootNode, 0}};  // (node, depth)
  while (!stack.empty()) {
    const auto [v, depth] = stack.back();
    stack.pop_back();
    const Node& n = nodes_[v];
    out += std::string(2 * depth, ' ') + "#" + std::to_string(v);
    if (v == kRootNode) out += " root";
    else
      out += " len=" + std::to_string(n.key.size()) + " tokens=" + list_str(n.key) + " slots=" + list_str(n.slots) +
             " lock=" + std::to_string(n.lock_ref) + " t=" + std::to_string(n.last_access);
    out += "\n";
    for (auto it = n.children.rbegin(); it != n.children.rend(); ++it) stack.emplace_back(it->id, depth + 1);
  }
  return out;
}

}  // namespace fasttree
