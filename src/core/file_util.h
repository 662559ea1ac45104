// Writing files without ever leaving a half-written one behind: write a temp file beside the
// target, fsync, rename over it.
#pragma once
#include <string>

namespace meshtune {

void write_file_atomic(const std::string& path, const std::string& contents);
void copy_file_atomic(const std::string& from, const std::string& to);
std::string read_file(const std::string& path);  // throws Error naming the file

}  // namespace meshtune
