// Path of the fasttree CLI under test: $FASTTREE_CLI when set (binaries carried to another machine,
// e.g. the GPU machine's copy of build-gpu), else the build tree's binary.
#pragma once
#include <cstdlib>
#include <string>

inline std::string cli_path() {
  const char* env = std::getenv("FASTTREE_CLI");
  return env != nullptr && *env != '\0' ? std::string(env) : std::string(FASTTREE_CLI_PATH);
}
