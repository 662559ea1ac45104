// Errors: every failure a user can cause is a meshtune::Error with a message that names the
// file, tensor, rule or dimension at fault. The CLI prints it to stderr and exits non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace meshtune {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
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

}  // namespace meshtune
