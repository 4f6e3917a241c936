// Tests for SlotPool, RadixCache (match / insert / lock / LRU evict) and build_kv_tree, including a
// randomized comparison against a simple reference model (prefix -> slot map).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/cache_tree.h"
#include "core/error.h"
#include "core/kv_tree.h"
#include "core/radix_cache.h"
#include "core/slot_pool.h"

namespace fasttree {
namespace {

using Vec = std::vector<int32_t>;

Vec to_vec(std::span<const int32_t> s) { return Vec(s.begin(), s.end()); }
Vec head(const Vec& v, int64_t n) { return Vec(v.begin(), v.begin() + n); }
Vec concat(Vec a, const Vec& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Tokens on the cache path root -> node.
Vec path_tokens(const RadixCache& c, NodeId node) {
  std::vector<NodeId> chain;
  for (NodeId v = node; v != kNoNode; v = c.node_parent(v)) chain.push_back(v);
  Vec out;
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    auto k = c.node_key(*it);
    out.insert(out.end(), k.begin(), k.end());
  }
  return out;
}

// Every cached prefix (as a token sequence) -> the slot of its last token.
std::map<Vec, int32_t> snapshot(const RadixCache& c) {
  std::map<Vec, int32_t> out;
  for (NodeId id = 1; id < c.node_id_bound(); ++id) {
    if (!c.is_valid(id)) continue;
    Vec path = path_tokens(c, c.node_parent(id));
    auto key = c.node_key(id);
    auto slots = c.node_slots(id);
    for (size_t i = 0; i < key.size(); ++i) {
      path.push_back(key[i]);
      out[path] = slots[i];
    }
  }
  return out;
}

// ---- SlotPool -----------------------------------------------------------------------------------

TEST(SlotPool, AllocAndFree) {
  SlotPool pool(8);
  EXPECT_EQ(pool.capacity(), 8);
  EXPECT_EQ(pool.num_free(), 8);
  Vec a = pool.alloc(3);
  EXPECT_EQ(a, (Vec{0, 1, 2}));
  EXPECT_EQ(pool.num_free(), 5);
  EXPECT_TRUE(pool.is_in_use(1));
  EXPECT_FALSE(pool.is_in_use(3));
  EXPECT_TRUE(pool.alloc(0).empty());
  pool.free(a);
  EXPECT_EQ(pool.num_free(), 8);
  EXPECT_FALSE(pool.is_in_use(1));
  // Freed slots come back in the order they were freed (runs of consecutive slots stay runs).
  EXPECT_EQ(pool.alloc(3), (Vec{0, 1, 2}));
  pool.free(Vec{2, 0, 1});
  EXPECT_EQ(pool.alloc(2), (Vec{2, 0}));
  pool.free(Vec{2, 0});
  Vec b;
  ASSERT_TRUE(pool.try_alloc(8, b));
  EXPECT_EQ(b.size(), 8u);
  std::sort(b.begin(), b.end());
  Vec all(8);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(b, all);
  EXPECT_EQ(pool.num_free(), 0);
}

TEST(SlotPool, ExhaustionThrowsAndAllocatesNothing) {
  SlotPool pool(8);
  Vec a = pool.alloc(5);
  try {
    pool.alloc(4);
    FAIL() << "expected an exhaustion error";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "KV pool exhausted: requested 4 slots, 3 free (capacity 8)");
  }
  EXPECT_EQ(pool.num_free(), 3);
  Vec out{42};
  EXPECT_FALSE(pool.try_alloc(4, out));
  EXPECT_EQ(out, Vec{42});
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_THROW(pool.alloc(-1), Error);
  EXPECT_TRUE(pool.try_alloc(3, out));
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_THROW(SlotPool(-1), Error);
}

TEST(SlotPool, DoubleFreeAndOutOfRangeRejected) {
  SlotPool pool(4);
  Vec a = pool.alloc(3);  // 0 1 2
  pool.free(Vec{1});
  EXPECT_THROW(pool.free(Vec{1}), Error);            // double free
  EXPECT_THROW(pool.free(Vec{0, 0}), Error);         // double free within one call
  EXPECT_TRUE(pool.is_in_use(0));                    // ... frees nothing
  EXPECT_THROW(pool.free(Vec{2, 4}), Error);         // out of range
  EXPECT_THROW(pool.free(Vec{2, -1}), Error);
  EXPECT_TRUE(pool.is_in_use(2));
  EXPECT_EQ(pool.num_free(), 2);
  try {
    pool.free(Vec{3});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("double free of slot 3"), std::string::npos) << e.message();
  }
  pool.free(Vec{0, 2});
  EXPECT_EQ(pool.num_free(), 4);
}

// ---- RadixCache: match / insert -------------------------------------------------------------------

TEST(RadixCache, MatchOnEmptyCache) {
  SlotPool pool(16);
  RadixCache cache(pool);
  auto m = cache.match_prefix(Vec{1, 2, 3});
  EXPECT_EQ(m.node, kRootNode);
  EXPECT_EQ(m.length, 0);
  EXPECT_TRUE(m.slots.empty());
  EXPECT_EQ(cache.match_prefix(Vec{}).length, 0);
  EXPECT_EQ(cache.num_nodes(), 1);
  EXPECT_EQ(cache.total_tokens(), 0);
  cache.check_invariants();
}

TEST(RadixCache, InsertThenMatchFullAndPartialPrefixes) {
  SlotPool pool(16);
  RadixCache cache(pool);
  const Vec toks{10, 11, 12, 13, 14, 15};
  const Vec slots = pool.alloc(6);
  auto ins = cache.insert(toks, slots);
  EXPECT_EQ(ins.cached_prefix, 0);
  EXPECT_EQ(to_vec(cache.node_key(ins.node)), toks);
  EXPECT_EQ(cache.total_tokens(), 6);
  EXPECT_EQ(cache.num_nodes(), 2);

  auto full = cache.match_prefix(toks);
  EXPECT_EQ(full.length, 6);
  EXPECT_EQ(full.slots, slots);
  EXPECT_EQ(full.node, ins.node);

  auto longer = cache.match_prefix(Vec{10, 11, 12, 13, 14, 15, 16});
  EXPECT_EQ(longer.length, 6);
  EXPECT_EQ(longer.node, ins.node);

  // Ends mid-node: the node is split, the returned node ends exactly at the match.
  auto part = cache.match_prefix(Vec{10, 11, 12, 99});
  EXPECT_EQ(part.length, 3);
  EXPECT_EQ(part.slots, head(slots, 3));
  EXPECT_EQ(to_vec(cache.node_key(part.node)), (Vec{10, 11, 12}));
  EXPECT_EQ(cache.num_nodes(), 3);
  // The old handle keeps naming the full sequence (its lower part).
  EXPECT_EQ(cache.node_parent(ins.node), part.node);
  EXPECT_EQ(to_vec(cache.node_key(ins.node)), (Vec{13, 14, 15}));
  EXPECT_EQ(to_vec(cache.node_slots(ins.node)), (Vec{slots[3], slots[4], slots[5]}));
  EXPECT_EQ(path_tokens(cache, ins.node), toks);
  EXPECT_EQ(cache.node_depth_tokens(part.node), 3);
  cache.check_invariants();

  // Match exactly at the split boundary: no further split.
  auto at = cache.match_prefix(Vec{10, 11, 12});
  EXPECT_EQ(at.node, part.node);
  EXPECT_EQ(cache.num_nodes(), 3);
  // Second split inside the lower part.
  auto p2 = cache.match_prefix(Vec{10, 11, 12, 13, 14});
  EXPECT_EQ(p2.length, 5);
  EXPECT_EQ(p2.slots, head(slots, 5));
  EXPECT_EQ(cache.num_nodes(), 4);
  EXPECT_EQ(cache.match_prefix(Vec{11}).length, 0);
  EXPECT_EQ(cache.total_tokens(), 6);
  cache.check_invariants();
}

TEST(RadixCache, InsertOverlappingReturnsCachedPrefix) {
  SlotPool pool(32);
  RadixCache cache(pool);
  const Vec a{1, 2, 3, 4};
  const Vec sa = pool.alloc(4);
  EXPECT_EQ(cache.insert(a, sa).cached_prefix, 0);

  const Vec b{1, 2, 5, 6};
  const Vec sb = pool.alloc(4);
  auto ib = cache.insert(b, sb);
  EXPECT_EQ(ib.cached_prefix, 2);
  pool.free(head(sb, 2));  // duplicates stay with the caller
  EXPECT_EQ(path_tokens(cache, ib.node), b);
  EXPECT_EQ(cache.match_prefix(b).slots, (Vec{sa[0], sa[1], sb[2], sb[3]}));
  EXPECT_EQ(cache.match_prefix(a).slots, sa);

  // Re-inserting a cached sequence adopts nothing.
  auto again = cache.insert(a, sa);
  EXPECT_EQ(again.cached_prefix, 4);
  EXPECT_EQ(path_tokens(cache, again.node), a);
  // Inserting a strict prefix of cached data splits and returns the exact node.
  const Vec pre{1, 2, 3};
  auto ip = cache.insert(pre, head(sa, 3));
  EXPECT_EQ(ip.cached_prefix, 3);
  EXPECT_EQ(path_tokens(cache, ip.node), pre);
  // Inserting a longer sequence through a mid-node mismatch.
  const Vec c{1, 2, 5, 7, 8};
  Vec sc = pool.alloc(5);
  auto ic = cache.insert(c, sc);
  EXPECT_EQ(ic.cached_prefix, 3);
  pool.free(head(sc, 3));
  EXPECT_EQ(cache.match_prefix(c).slots, (Vec{sa[0], sa[1], sb[2], sc[3], sc[4]}));
  // Empty insert.
  auto ie = cache.insert(Vec{}, Vec{});
  EXPECT_EQ(ie.cached_prefix, 0);
  EXPECT_EQ(ie.node, kRootNode);

  EXPECT_EQ(cache.total_tokens(), 8);
  EXPECT_EQ(pool.num_free() + cache.total_tokens(), pool.capacity());
  cache.check_invariants();
}

TEST(RadixCache, InsertRejectsBadArguments) {
  SlotPool pool(8);
  RadixCache cache(pool);
  Vec s = pool.alloc(2);
  EXPECT_THROW(cache.insert(Vec{1, 2, 3}, s), Error);       // size mismatch
  EXPECT_THROW(cache.insert(Vec{1, 2}, Vec{s[0], 5}), Error);  // slot 5 not allocated
  EXPECT_THROW(cache.insert(Vec{1, 2}, Vec{s[0], 99}), Error); // out of range
  EXPECT_EQ(cache.total_tokens(), 0);
  EXPECT_EQ(cache.num_nodes(), 1);
  cache.check_invariants();
}

// ---- RadixCache: lock / evict -------------------------------------------------------------------

TEST(RadixCache, LockPreventsEviction) {
  SlotPool pool(32);
  RadixCache cache(pool);
  auto ia = cache.insert(Vec{1, 2, 3, 4}, pool.alloc(4));
  Vec sb = pool.alloc(4);
  auto ib = cache.insert(Vec{1, 2, 5, 6}, sb);
  pool.free(head(sb, 2));
  cache.lock(ia.node);
  EXPECT_EQ(cache.node_lock_ref(ia.node), 1);
  EXPECT_EQ(cache.node_lock_ref(cache.node_parent(ia.node)), 1);
  EXPECT_EQ(cache.locked_tokens(), 4);
  EXPECT_EQ(cache.evictable_tokens(), 2);
  cache.check_invariants();

  EXPECT_EQ(cache.evict(100), 2);  // only b's private part
  EXPECT_FALSE(cache.is_valid(ib.node));
  EXPECT_EQ(cache.match_prefix(Vec{1, 2, 3, 4}).length, 4);
  EXPECT_EQ(cache.evict(100), 0);
  cache.lock(ia.node);  // a second holder
  cache.unlock(ia.node);
  EXPECT_EQ(cache.evict(100), 0);
  cache.unlock(ia.node);
  EXPECT_EQ(cache.locked_tokens(), 0);
  EXPECT_EQ(cache.evictable_tokens(), 4);
  EXPECT_THROW(cache.unlock(ia.node), Error);  // below zero
  EXPECT_EQ(cache.evict(1), 2);  // leaf [3 4]: enough, its parent [1 2] stays
  EXPECT_EQ(cache.total_tokens(), 2);
  EXPECT_EQ(cache.evict(1), 2);  // then the parent, now an unlocked leaf
  EXPECT_EQ(cache.total_tokens(), 0);
  EXPECT_EQ(pool.num_free(), 32);
  EXPECT_THROW(cache.lock(ia.node), Error);  // evicted handle
  EXPECT_THROW(cache.lock(12345), Error);
  cache.lock(kRootNode);  // no-ops
  cache.unlock(kRootNode);
  cache.check_invariants();
}

TEST(RadixCache, SplitPreservesLocksAndAccessTime) {
  SlotPool pool(16);
  RadixCache cache(pool);
  auto ia = cache.insert(Vec{1, 2, 3, 4, 5, 6}, pool.alloc(6));
  cache.lock(ia.node);
  const uint64_t t = cache.node_last_access(ia.node);
  auto ib = cache.insert(Vec{1, 2, 3, 9}, pool.alloc(4));  // splits the locked node after 3
  const NodeId upper = cache.node_parent(ia.node);
  EXPECT_EQ(cache.node_parent(ib.node), upper);
  EXPECT_EQ(cache.node_lock_ref(upper), 1);
  EXPECT_GE(cache.node_last_access(upper), t);
  EXPECT_EQ(cache.locked_tokens(), 6);
  EXPECT_EQ(cache.evictable_tokens(), 1);
  cache.check_invariants();
  cache.unlock(ia.node);
  EXPECT_EQ(cache.node_lock_ref(upper), 0);
  EXPECT_EQ(cache.locked_tokens(), 0);
  cache.check_invariants();
}

TEST(RadixCache, EvictsLeastRecentlyUsedFirst) {
  SlotPool pool(32);
  RadixCache cache(pool);
  const Vec x{1, 1, 1}, y{2, 2}, z{3, 3, 3, 3};
  auto ix = cache.insert(x, pool.alloc(3));
  auto iy = cache.insert(y, pool.alloc(2));
  auto iz = cache.insert(z, pool.alloc(4));
  cache.match_prefix(x);  // access order now: y (oldest), z, x
  EXPECT_LT(cache.node_last_access(iy.node), cache.node_last_access(iz.node));
  EXPECT_EQ(cache.evict(1), 2);  // y goes first, whole node
  EXPECT_FALSE(cache.is_valid(iy.node));
  EXPECT_TRUE(cache.is_valid(ix.node) && cache.is_valid(iz.node));
  EXPECT_EQ(cache.evict(1), 4);  // then z
  EXPECT_FALSE(cache.is_valid(iz.node));
  EXPECT_EQ(cache.match_prefix(x).length, 3);
  EXPECT_EQ(pool.num_free(), 32 - 3);
  cache.check_invariants();
}

TEST(RadixCache, EvictReturnsSlotsAndParentsBecomeEvictable) {
  SlotPool pool(16);
  RadixCache cache(pool);
  cache.insert(Vec{1, 2, 3, 4}, pool.alloc(4));
  Vec s = pool.alloc(4);
  cache.insert(Vec{1, 2, 5, 6}, s);
  pool.free(head(s, 2));
  cache.insert(Vec{7, 8, 9}, pool.alloc(3));
  cache.match_prefix(Vec{7});  // [7 8 9] is split and most recently used
  EXPECT_EQ(cache.num_nodes(), 6);
  EXPECT_EQ(pool.num_free(), 16 - 9);
  // Needs more than both leaves under [1 2]: the parent becomes a leaf and goes too, before [7..].
  EXPECT_EQ(cache.evict(5), 6);
  EXPECT_EQ(cache.match_prefix(Vec{1, 2}).length, 0);
  EXPECT_EQ(cache.match_prefix(Vec{7, 8, 9}).length, 3);
  EXPECT_EQ(pool.num_free(), 16 - 3);
  cache.check_invariants();
  EXPECT_EQ(cache.evict(1), 2);  // leaf [8 9] of the split chain
  EXPECT_EQ(cache.evict(1), 1);  // then its parent [7]
  EXPECT_EQ(cache.num_nodes(), 1);
  EXPECT_EQ(pool.num_free(), 16);
  EXPECT_EQ(cache.evict(1), 0);
  EXPECT_EQ(cache.evict(0), 0);
  EXPECT_THROW(cache.evict(-1), Error);
  cache.check_invariants();
}

TEST(RadixCache, ExhaustionEvictThenAllocSucceeds) {
  SlotPool pool(10);
  RadixCache cache(pool);
  cache.insert(Vec{1, 2, 3, 4, 5}, pool.alloc(5));
  auto keep = cache.insert(Vec{6, 7, 8}, pool.alloc(3));
  cache.lock(keep.node);
  EXPECT_THROW(pool.alloc(5), Error);
  Vec out;
  EXPECT_FALSE(pool.try_alloc(5, out));
  const int64_t need = 5 - pool.num_free();
  EXPECT_GE(cache.evict(need), need);
  EXPECT_TRUE(pool.try_alloc(5, out));
  EXPECT_EQ(cache.match_prefix(Vec{6, 7, 8}).length, 3);
  // Not enough evictable: evict frees what it can and alloc still fails.
  EXPECT_EQ(cache.evict(100), 0);
  EXPECT_FALSE(pool.try_alloc(3, out));
  cache.check_invariants();
}

TEST(RadixCache, ResetAndDump) {
  SlotPool pool(16);
  RadixCache cache(pool);
  auto a = cache.insert(Vec{1, 2, 3}, pool.alloc(3));
  cache.insert(Vec{1, 4}, Vec{cache.match_prefix(Vec{1}).slots[0], pool.alloc(1)[0]});
  const std::string d = cache.dump();
  EXPECT_NE(d.find("root"), std::string::npos);
  EXPECT_NE(d.find("tokens=[2 3]"), std::string::npos) << d;
  cache.lock(a.node);
  EXPECT_THROW(cache.reset(), Error);
  cache.unlock(a.node);
  cache.reset();
  EXPECT_EQ(cache.num_nodes(), 1);
  EXPECT_EQ(cache.total_tokens(), 0);
  EXPECT_EQ(pool.num_free(), 16);
  EXPECT_EQ(cache.match_prefix(Vec{1, 2}).length, 0);
  cache.check_invariants();
}

// ---- randomized comparison against a reference model ------------------------------------------

struct Held {
  NodeId node;
  Vec tokens;  // the node's path when it was locked; must never change while locked
};

void run_random(uint32_t seed, int ops) {
  constexpr int32_t kCapacity = 160;
  SlotPool pool(kCapacity);
  RadixCache cache(pool);
  std::map<Vec, int32_t> ref;  // cached prefix -> slot of its last token
  std::vector<Held> held;
  std::vector<Vec> history;
  std::mt19937 rng(seed);
  auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };

  auto ref_match = [&](const Vec& t) {
    Vec slots;
    Vec p;
    for (int32_t x : t) {
      p.push_back(x);
      auto it = ref.find(p);
      if (it == ref.end()) break;
      slots.push_back(it->second);
    }
    return slots;
  };
  auto gen = [&]() {
    Vec t;
    if (!history.empty() && rnd(0, 2) > 0) {
      const Vec& h = history[rnd(0, static_cast<int>(history.size()) - 1)];
      t = head(h, rnd(0, static_cast<int>(h.size())));
    }
    const int extra = rnd(t.empty() ? 1 : 0, 10);
    for (int i = 0; i < extra; ++i) t.push_back(rnd(0, 3));
    if (history.size() < 64) history.push_back(t);
    else history[rnd(0, 63)] = t;
    return t;
  };
  // Allocates n slots, evicting when needed; false if even eviction cannot make room.
  auto alloc = [&](int64_t n, Vec& out) {
    if (pool.try_alloc(n, out)) return true;
    const int64_t need = n - pool.num_free();
    const std::map<Vec, int32_t> before = ref;
    const int64_t freed = cache.evict(need);
    EXPECT_TRUE(freed >= need || cache.evictable_tokens() == 0);
    ref = snapshot(cache);
    EXPECT_EQ(static_cast<int64_t>(before.size() - ref.size()), freed);
    return pool.try_alloc(n, out);
  };

  for (int op = 0; op < ops; ++op) {
    SCOPED_TRACE("seed " + std::to_string(seed) + " op " + std::to_string(op));
    const int kind = rnd(0, 99);
    const Vec t = gen();
    if (kind < 20) {  // insert with fresh slots for every token; free the duplicates
      const Vec expect = ref_match(t);
      Vec s;
      if (alloc(static_cast<int64_t>(t.size()), s)) {
        const Vec expect2 = ref_match(t);  // eviction may have shortened the cached prefix
        ASSERT_LE(expect2.size(), expect.size());
        auto r = cache.insert(t, s);
        ASSERT_EQ(r.cached_prefix, static_cast<int64_t>(expect2.size()));
        ASSERT_EQ(path_tokens(cache, r.node), t);
        pool.free(head(s, r.cached_prefix));
        Vec p = head(t, r.cached_prefix);
        for (size_t i = r.cached_prefix; i < t.size(); ++i) {
          p.push_back(t[i]);
          ref[p] = s[i];
        }
      }
    } else if (kind < 40) {  // engine style: match, lock, alloc tail, insert, swap locks
      auto m = cache.match_prefix(t);
      ASSERT_EQ(m.slots, ref_match(t));
      cache.lock(m.node);
      Vec tail;
      if (alloc(static_cast<int64_t>(t.size()) - m.length, tail)) {
        ASSERT_EQ(m.slots, ref_match(head(t, m.length)));  // locked prefix survived eviction
        auto r = cache.insert(t, concat(m.slots, tail));
        ASSERT_EQ(r.cached_prefix, m.length);
        Vec p = head(t, m.length);
        for (size_t i = 0; i < tail.size(); ++i) {
          p.push_back(t[m.length + i]);
          ref[p] = tail[i];
        }
        if (held.size() < 6 && rnd(0, 1)) {
          cache.lock(r.node);
          held.push_back({r.node, t});
        }
      }
      cache.unlock(m.node);
    } else if (kind < 65) {  // match
      auto m = cache.match_prefix(t);
      const Vec expect = ref_match(t);
      ASSERT_EQ(m.length, static_cast<int64_t>(expect.size()));
      ASSERT_EQ(m.slots, expect);
      ASSERT_EQ(path_tokens(cache, m.node), head(t, m.length));
    } else if (kind < 75) {  // lock a matched prefix
      if (held.size() < 6) {
        auto m = cache.match_prefix(t);
        cache.lock(m.node);
        held.push_back({m.node, head(t, m.length)});
      }
    } else if (kind < 87) {  // unlock
      if (!held.empty()) {
        const size_t i = static_cast<size_t>(rnd(0, static_cast<int>(held.size()) - 1));
        cache.unlock(held[i].node);
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
      }
    } else if (kind < 99) {  // evict
      const int64_t want = rnd(1, 40);
      const int32_t free0 = pool.num_free();
      const int64_t freed = cache.evict(want);
      ASSERT_EQ(pool.num_free(), free0 + freed);
      ASSERT_TRUE(freed >= want || cache.evictable_tokens() == 0);
      const auto snap = snapshot(cache);
      for (const auto& [p, s] : snap) {  // eviction only removes prefixes
        auto it = ref.find(p);
        ASSERT_TRUE(it != ref.end() && it->second == s);
      }
      ASSERT_EQ(static_cast<int64_t>(ref.size() - snap.size()), freed);
      ref = snap;
    } else if (held.empty()) {  // rare full reset
      cache.reset();
      ref.clear();
    }

    // Whole-state checks after every operation.
    cache.check_invariants();
    ASSERT_EQ(snapshot(cache), ref);
    ASSERT_EQ(cache.total_tokens(), static_cast<int64_t>(ref.size()));
    ASSERT_EQ(pool.num_free() + cache.total_tokens(), kCapacity);
    std::set<Vec> locked_prefixes;
    for (const Held& h : held) {
      ASSERT_TRUE(cache.is_valid(h.node));
      ASSERT_EQ(path_tokens(cache, h.node), h.tokens);
      for (size_t k = 1; k <= h.tokens.size(); ++k) locked_prefixes.insert(head(h.tokens, k));
    }
    ASSERT_EQ(cache.locked_tokens(), static_cast<int64_t>(locked_prefixes.size()));
  }
  for (const Held& h : held) cache.unlock(h.node);
  EXPECT_EQ(cache.locked_tokens(), 0);
  cache.evict(kCapacity);
  EXPECT_EQ(pool.num_free(), kCapacity);
  EXPECT_EQ(cache.num_nodes(), 1);
}

TEST(RadixCache, RandomizedAgainstReferenceModel) {
  for (uint32_t seed : {1u, 2u, 3u, 4u}) run_random(seed, 3000);
}

// ---- build_kv_tree ------------------------------------------------------------------------------

// Slots on the KvTree path root -> node.
Vec tree_path_slots(const KvTree& tree, int node) {
  std::vector<int> chain;
  for (int v = node; v >= 0; v = tree.parent[v]) chain.push_back(v);
  Vec out;
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    auto s = tree.node_slots(*it);
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

TEST(RadixCache, BuildKvTreeFromRequests) {
  SlotPool pool(64);
  RadixCache cache(pool);
  const Vec s1{1, 2, 3, 4, 5, 6}, s2{1, 2, 3, 7, 8}, s3{9, 9};
  cache.insert(s1, pool.alloc(6));
  Vec d = pool.alloc(5);
  pool.free(head(d, cache.insert(s2, d).cached_prefix));
  cache.insert(s3, pool.alloc(2));

  struct Req {
    Vec prefix;
    int tail_len;
  };
  const std::vector<Req> spec{{s1, 2}, {{1, 2, 3, 7}, 3}, {{}, 1}, {s3, 2}, {s1, 0}, {{1, 2, 3}, 1}};
  std::vector<LiveRequest> reqs;
  std::vector<Vec> prefix_slots;
  for (const Req& r : spec) {
    auto m = cache.match_prefix(r.prefix);
    ASSERT_EQ(m.length, static_cast<int64_t>(r.prefix.size()));
    cache.lock(m.node);
    reqs.push_back({m.node, pool.alloc(r.tail_len)});
    prefix_slots.push_back(m.slots);
  }
  cache.check_invariants();

  std::vector<NodeId> tree_to_cache;
  const KvTree tree = build_kv_tree(cache, reqs, &tree_to_cache);
  validate_tree(tree, pool.capacity());
  // Cache nodes on the paths: [1 2 3], [4 5 6], [7], [9 9] (not [8]); plus 6 tail nodes.
  ASSERT_EQ(tree.num_nodes(), 4 + 6);
  ASSERT_EQ(tree.num_queries(), 6);
  ASSERT_EQ(tree_to_cache.size(), 10u);
  int roots = 0;
  for (int i = 0; i < tree.num_nodes(); ++i) {
    EXPECT_LT(tree.parent[i], i);  // parents before children
    roots += tree.parent[i] < 0;
    if (i < 4) {
      ASSERT_TRUE(cache.is_valid(tree_to_cache[i]));
      EXPECT_EQ(to_vec(tree.node_slots(i)), to_vec(cache.node_slots(tree_to_cache[i])));
    } else {
      EXPECT_EQ(tree_to_cache[i], kNoNode);
    }
  }
  EXPECT_EQ(roots, 3);  // [1 2 3], [9 9], and the tail of the request at the cache root
  for (size_t q = 0; q < reqs.size(); ++q) {
    EXPECT_EQ(tree.query_node[q], static_cast<int>(4 + q));
    EXPECT_EQ(tree_path_slots(tree, tree.query_node[q]), concat(prefix_slots[q], reqs[q].tail_slots)) << "query " << q;
  }
  EXPECT_EQ(tree.parent[4 + 2], -1);
  EXPECT_EQ(tree.node_len(4 + 4), 0);  // empty tail

  // No requests: empty tree. Bad handles and tail slots are rejected.
  EXPECT_EQ(build_kv_tree(cache, {}).num_nodes(), 0);
  std::vector<LiveRequest> bad{{9999, {}}};
  EXPECT_THROW(build_kv_tree(cache, bad), Error);
  bad = {{kRootNode, {64}}};
  EXPECT_THROW(build_kv_tree(cache, bad), Error);
  for (const LiveRequest& r : reqs) cache.unlock(r.node);
  cache.check_invariants();
}

}  // namespace
}  // namespace fasttree
