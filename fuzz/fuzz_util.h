// Helpers for the libFuzzer targets: the parsers read files, so each input is written to a file
// first (one per target process, rewritten every iteration), and only meshtune::Error is an
// expected outcome — anything else (a crash, a sanitizer report, another exception) is a finding.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"

namespace meshtune::fuzz {

// A scratch directory for this process, created once.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const std::string d = (std::filesystem::temp_directory_path() / ("meshtune-fuzz-" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

// Writes bytes to scratch_dir()/name and returns the path.
inline std::string write_input(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  return path;
}

// Runs fn; a meshtune::Error is the parser refusing the input, which is fine.
template <typename Fn>
void expect_only_errors(Fn&& fn) {
  try {
    fn();
  } catch (const meshtune::Error&) {
  }
}

}  // namespace meshtune::fuzz
