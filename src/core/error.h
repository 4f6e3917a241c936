// Error type and checks. Every error carries the source location that raised it.
#pragma once
#include <stdexcept>
#include <string>

namespace fasttree {

// All recoverable failures (bad input, bad shapes, exhausted pools) throw this.
class Error : public std::runtime_error {
 public:
  Error(const std::string& what, const char* file, int line);
  const std::string& message() const { return message_; }  // without location
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  std::string message_;
  const char* file_;
  int line_;
};

[[noreturn]] void throw_error(const std::string& message, const char* file, int line);

}  // namespace fasttree

// FT_CHECK(cond, "message") — throws fasttree::Error naming file:line when cond is false.
// The message is any expression convertible to std::string (built only on failure).
#define FT_CHECK(cond, msg)                                             \
  do {                                                                  \
    if (!(cond)) ::fasttree::throw_error((msg), __FILE__, __LINE__);    \
  } while (0)

#define FT_FAIL(msg) ::fasttree::throw_error((msg), __FILE__, __LINE__)
