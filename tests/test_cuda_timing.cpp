// The timing harness's L2 modes (cuda/timing.cpp): names, and on a GPU that rotated copies and the
// flushes leave the inputs cold while the warm mode does not.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/attention_shape.h"
#include "core/error.h"
#include "core/tree_gen.h"
#include "cuda/backend.h"
#include "plan/planner.h"

namespace fasttree {
namespace {

TEST(CudaTiming, L2ModeNames) {
  for (L2Mode m : {L2Mode::kRotate, L2Mode::kCleanFlush, L2Mode::kDirtyFlush, L2Mode::kWarm})
    EXPECT_EQ(parse_l2_mode(l2_mode_name(m)), m);
  EXPECT_EQ(parse_l2_mode("rotate"), L2Mode::kRotate);
  EXPECT_EQ(CudaTimingOptions{}.l2, L2Mode::kRotate);
  for (const char* bad : {"", "Rotate", "flush", "none", "rotate "}) {
    try {
      parse_l2_mode(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("unknown L2 mode"), std::string::npos) << e.what();
    }
  }
}

// 24 MB of K/V (one 4096-token root, 4 leaves of 512; 32/8 heads, d = 128): it fits in the H200's
// 50 MB L2, so a warm run reads it from L2 and must be clearly faster than a run whose inputs were
// pushed out by the other rotated copies or by either flush.
TEST(CudaTiming, RotatedAndFlushedInputsAreCold) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const std::vector<int64_t> levels{1, 4}, lens{4096, 512};
  const KvTree tree = tree_from_levels(levels, lens);
  const AttnShape s{32, 8, 128};
  Plan plan;
  Planner().build(tree, s, plan);
  auto time = [&](L2Mode m) {
    CudaTimingOptions opt;
    opt.iters = 30;
    opt.use_graph = true;
    opt.l2 = m;
    const CudaTiming t = cuda_time_plan(plan, tree, s, KvDType::kF16, opt);
    EXPECT_TRUE(std::isfinite(t.median_us) && t.median_us > 0) << l2_mode_name(m);
    EXPECT_EQ(t.runs, 30);
    EXPECT_EQ(t.copies > 1, m == L2Mode::kRotate) << l2_mode_name(m) << ": " << t.copies << " copies";
    return t.median_us;
  };
  const double warm = time(L2Mode::kWarm), rotate = time(L2Mode::kRotate), clean = time(L2Mode::kCleanFlush),
               dirty = time(L2Mode::kDirtyFlush);
  std::printf("warm %.1f us, rotate %.1f, clean %.1f, dirty %.1f\n", warm, rotate, clean, dirty);
  EXPECT_LT(warm, 0.85 * rotate);
  EXPECT_LT(warm, 0.85 * clean);
  EXPECT_LT(warm, 0.85 * dirty);
}

}  // namespace
}  // namespace fasttree
