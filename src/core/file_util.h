// Writing files without ever leaving a half-written one behind: write a temp file beside the
// target, fsync, rename over it.
#pragma once
#include <cstddef>
#include <string>

namespace meshtune {

void write_file_atomic(const std::string& path, const std::string& contents);
void copy_file_atomic(const std::string& from, const std::string& to);
// The whole file; throws Error naming the file when it cannot be read or is over `max_bytes`.
std::string read_file(const std::string& path, size_t max_bytes = size_t(-1));
// `dir`/`name` for a name read from a file (an index, a manifest): it must be a plain file name —
// not empty, not "." or "..", no '/' or NUL — so a hostile file cannot reach outside `dir`.
// `what` names the file and entry for the error.
std::string plain_file_in(const std::string& dir, const std::string& name, const std::string& what);

}  // namespace meshtune
