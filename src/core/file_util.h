// Files in and out. Every writer in the tree goes through write_atomically, so no run ever leaves
// a half-written file or loses the previous one: a temp file beside the target, fsync, rename over
// it, fsync of the directory.
#pragma once
#include <cstddef>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace meshtune {

// `write` fills a temp file beside `path` by any means — our own bytes, libhdf5 — and closes it;
// then that file is fsynced and renamed over `path`, and the directory fsynced. If `write` throws or
// any step fails, the temp file is removed, `path` is left as it was and Error (naming `path`) is
// thrown. The temp file's name is the writer's own (`path`.meshtune-HOST-PID-N.tmp), so two writers
// never share one; temp files of `path` left by a writer on this host that no longer runs (killed
// mid-write) are removed first.
void write_atomically(const std::string& path, const std::function<void(const std::string& tmp_path)>& write);
// The temp files of `path` that exist now (any writer's), for tests and run-directory checks.
std::vector<std::string> temp_files_of(const std::string& path);
bool is_temp_file_of(const std::string& name, const std::string& target_name);  // file names, no directories
// The same with a stdio stream: `write` puts the bytes into `out` (a failed fwrite is caught at close).
void write_stream_atomically(const std::string& path, const std::function<void(std::FILE* out)>& write);
void write_file_atomic(const std::string& path, const std::string& contents);
void copy_file_atomic(const std::string& from, const std::string& to);
// The whole file; throws Error naming the file when it cannot be read or is over `max_bytes`.
std::string read_file(const std::string& path, size_t max_bytes = size_t(-1));
// `dir`/`name` for a name read from a file (an index, a manifest): it must be a plain file name —
// not empty, not "." or "..", no '/' or NUL — so a hostile file cannot reach outside `dir`.
// `what` names the file and entry for the error.
std::string plain_file_in(const std::string& dir, const std::string& name, const std::string& what);

// Drops the whole pages of [data, data + bytes) — part of a read-only file mapping — from this
// process' memory (madvise DONTNEED; touched again, they are read again from the file). Loading
// calls it once a mapped tensor has been converted into a copy, so the copy does not come on top.
void release_mapped_pages(const void* data, size_t bytes);

}  // namespace meshtune
