// Steady-state planning must not allocate: rebuilding a plan for a tree of the same (or smaller)
// size reuses the planner's workspace and the plan's buffers. Counted with a global operator new.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "core/tree_gen.h"
#include "engine/plan_extend.h"
#include "plan/planner.h"

namespace {
std::atomic<long> g_allocations{0};
}

void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace fasttree {
namespace {

TEST(PlannerAlloc, RebuildDoesNotAllocate) {
  const KvTree big = tree_from_levels(std::vector<int64_t>{1, 16, 64, 256}, std::vector<int64_t>{1024, 256, 64, 16});
  RandomForestSpec spec;
  spec.max_depth = 5;
  spec.max_fanout = 4;
  const KvTree small = random_forest(spec, 3);
  Planner planner;
  Plan plan;
  const AttnShape shape{32, 8, 128};
  planner.build(big, shape, plan);  // warm-up grows every buffer
  planner.build(small, shape, plan);
  const long before = g_allocations.load();
  for (int i = 0; i < 5; ++i) {
    planner.build(big, shape, plan);
    planner.build(small, shape, plan);
  }
  EXPECT_EQ(g_allocations.load() - before, 0);
}

// A decode step without re-planning (grow_query_leaves + extend_plan with the scheduler's scratch)
// allocates nothing once the buffers have grown: here the slot arrays are reserved for every step
// up front, as they are after the doubling regrowths of a long generation. (Without the scratch the
// same loop allocates 960 times.)
TEST(PlannerAlloc, ExtendingAPlanDoesNotAllocate) {
  KvTree tree;
  const int root = tree.add_node(-1, 200);
  for (int q = 0; q < 64; ++q) tree.add_query(tree.add_node(root, 3 + q % 7));
  PlannerConfig cfg;
  cfg.split = false;
  Planner planner(cfg);
  Plan plan;
  const AttnShape shape{32, 8, 128};
  planner.build(tree, shape, plan);
  PlanExtendScratch scratch;
  const int steps = 40;
  const size_t final_tokens = tree.slots.size() + static_cast<size_t>(64 * (steps + 2));
  tree.slots.reserve(final_tokens);
  scratch.slots.reserve(final_tokens);
  std::vector<int32_t> new_slots(64);
  int32_t next = static_cast<int32_t>(tree.num_tokens());
  auto step = [&] {
    for (auto& x : new_slots) x = next++;
    grow_query_leaves(tree, new_slots, &scratch);
    ASSERT_TRUE(extend_plan(plan, tree, cfg, &scratch));
  };
  step();  // warm-up: the scratch's per-node / per-item buffers
  step();
  const long before = g_allocations.load();
  for (int i = 0; i < steps; ++i) step();
  EXPECT_EQ(g_allocations.load() - before, 0);
  EXPECT_EQ(plan.vnode_len.size(), static_cast<size_t>(plan.num_vnodes()));
}

}  // namespace
}  // namespace fasttree
