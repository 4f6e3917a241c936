// Steady-state planning must not allocate: rebuilding a plan for a tree of the same (or smaller)
// size reuses the planner's workspace and the plan's buffers. Counted with a global operator new.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "core/tree_gen.h"
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

}  // namespace
}  // namespace fasttree
