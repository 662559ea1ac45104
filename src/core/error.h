// Errors: every failure a user can cause is a meshtune::Error with a message that names the
// file, tensor, rule or dimension at fault. The CLI prints it to stderr and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace meshtune {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A file or directory the user named does not exist (Python's FileNotFoundError).
struct FileNotFound : Error {
  using Error::Error;
};

// fail("file ", path, ": tensor ", name, " has shape ", shape) — concatenates with operator<<.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  throw Error(out.str());
}

template <typename... Args>
void check(bool ok, const Args&... args) {
  if (!ok) fail(args...);
}

template <typename... Args>
[[noreturn]] void fail_not_found(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  throw FileNotFound(out.str());
}

// At most `max_chars` of `text`, for error messages that quote a name or value from a file (which
// may be megabytes long).
inline std::string brief(std::string_view text, size_t max_chars = 80) {
  if (text.size() <= max_chars) return std::string(text);
  return std::string(text.substr(0, max_chars)) + "…(" + std::to_string(text.size()) + " bytes)";
}

}  // namespace meshtune
