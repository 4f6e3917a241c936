// Names of the timing harness's L2 modes (cuda/backend.h); built with and without CUDA.
#include <string>

#include "core/error.h"
#include "cuda/backend.h"

namespace fasttree {

namespace {
constexpr struct {
  L2Mode mode;
  const char* name;
} kL2Modes[] = {{L2Mode::kRotate, "rotate"}, {L2Mode::kCleanFlush, "clean"}, {L2Mode::kDirtyFlush, "dirty"}, {L2Mode::kWarm, "warm"}};
}  // namespace

L2Mode parse_l2_mode(const std::string& name) {
  for (const auto& m : kL2Modes)
    if (name == m.name) return m.mode;
  FT_FAIL("unknown L2 mode '" + name + "' (rotate, clean, dirty, warm)");
}

const char* l2_mode_name(L2Mode mode) {
  for (const auto& m : kL2Modes)
    if (mode == m.mode) return m.name;
  FT_FAIL("invalid L2 mode " + std::to_string(static_cast<int>(mode)));
}

}  // namespace fasttree
