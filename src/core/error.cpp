#include "core/error.h"

#include <cstring>

namespace fasttree {

namespace {
const char* short_path(const char* file) {
  const char* p = std::strstr(file, "src/");
  return p ? p : file;
}
}  // namespace

Error::Error(const std::string& what, const char* file, int line)
    : std::runtime_error(what + " [" + short_path(file) + ":" + std::to_string(line) + "]"),
      message_(what),
      file_(short_path(file)),
      line_(line) {}

void throw_error(const std::string& message, const char* file, int line) {
  throw Error(message, file, line);
}

}  // namespace fasttree
