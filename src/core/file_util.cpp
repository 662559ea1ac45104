#include "core/file_util.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace meshtune {

static void fsync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  check(fd >= 0, path, ": cannot open for fsync: ", std::strerror(errno));
  const int status = ::fsync(fd), err = errno;
  ::close(fd);
  check(status == 0, path, ": fsync failed: ", std::strerror(err));
}

namespace {

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || !name[0]) return "host";
  std::string s = name;
  for (char& c : s)
    if (c == '/' || c == '-') c = '_';  // keeps the name one path part whose fields split on '-'
  return s;
}

const std::string kTempTag = ".meshtune-";

// This writer's temp name for `path`: path.meshtune-HOST-PID-N.tmp.
std::string own_temp_name(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return path + kTempTag + host_name() + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + ".tmp";
}

// Removes temp files of `path` whose writer ran on this host and is gone (a killed export leaves a
// file as large as the model).
void remove_stale_temp_files(const std::string& path) {
  const std::string mine = std::filesystem::path(path).filename().string() + kTempTag + host_name() + "-";
  for (const std::string& tmp : temp_files_of(path)) {
    const std::string name = std::filesystem::path(tmp).filename().string();
    if (name.rfind(mine, 0) != 0) continue;  // another host's: it may still be writing
    const long pid = std::strtol(name.c_str() + mine.size(), nullptr, 10);
    if (pid > 0 && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH) ::unlink(tmp.c_str());
  }
}

}  // namespace

bool is_temp_file_of(const std::string& name, const std::string& target_name) {
  const std::string prefix = target_name + kTempTag;
  return name.size() > prefix.size() + 4 && name.rfind(prefix, 0) == 0 && name.compare(name.size() - 4, 4, ".tmp") == 0;
}

std::vector<std::string> temp_files_of(const std::string& path) {
  std::vector<std::string> out;
  const std::filesystem::path target(path);
  const std::filesystem::path dir = target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec))
    if (is_temp_file_of(entry.path().filename().string(), target.filename().string())) out.push_back(entry.path().string());
  return out;
}

void write_atomically(const std::string& path, const std::function<void(const std::string& tmp_path)>& write) {
  remove_stale_temp_files(path);
  const std::string tmp = own_temp_name(path);
  try {
    write(tmp);
    fsync_path(tmp, O_RDONLY);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail(path, ": cannot rename ", tmp, " over it: ", std::strerror(err));
  }
  // Make the rename itself durable. The new file is already in place, so a directory that cannot
  // be synced (some file systems refuse) is not an error.
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_stream_atomically(const std::string& path, const std::function<void(std::FILE* out)>& write) {
  write_atomically(path, [&](const std::string& tmp) {
    std::FILE* out = std::fopen(tmp.c_str(), "wb");
    check(out, path, ": cannot open ", tmp, " for writing: ", std::strerror(errno));
    try {
      write(out);
    } catch (...) {
      std::fclose(out);
      throw;
    }
    const bool ok = !std::ferror(out);
    const int err = errno;
    check(std::fclose(out) == 0 && ok, path, ": write failed: ", std::strerror(ok ? errno : err));
  });
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  write_stream_atomically(path, [&](std::FILE* out) {
    if (!contents.empty()) std::fwrite(contents.data(), 1, contents.size(), out);
  });
}

std::string read_file(const std::string& path, size_t max_bytes) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) fail_not_found(path, ": not found or not a regular file");
  const uintmax_t size = std::filesystem::file_size(path, ec);
  check(!ec, path, ": cannot get size: ", ec.message());
  check(size <= max_bytes, path, ": ", size, " bytes, more than the ", max_bytes, " this file may have");
  std::ifstream in(path, std::ios::binary);
  check(bool(in), path, ": cannot open: ", std::strerror(errno));
  std::string out(size_t(size), '\0');
  check(bool(in.read(out.data(), std::streamsize(size))), path, ": cannot read");
  return out;
}

std::string plain_file_in(const std::string& dir, const std::string& name, const std::string& what) {
  check(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
            name.find('\0') == std::string::npos,
        what, ": \"", name.size() > 80 ? name.substr(0, 80) + "…" : name, "\" is not a plain file name in ",
        dir.empty() ? "." : dir);
  return (std::filesystem::path(dir) / name).string();
}

void copy_file_atomic(const std::string& from, const std::string& to) { write_file_atomic(to, read_file(from)); }

void release_mapped_pages(const void* data, size_t bytes) {
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);  // a hint: errors change nothing
}

}  // namespace meshtune
