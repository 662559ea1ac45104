#include "core/file_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace meshtune {

void write_file_atomic(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  check(fd >= 0, path, ": cannot write: ", std::strerror(errno));
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail(path, ": write failed: ", std::strerror(err));
    }
    done += size_t(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    fail(path, ": fsync/close failed: ", std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    fail(path, ": rename failed: ", std::strerror(err));
  }
}

std::string read_file(const std::string& path, size_t max_bytes) {
  std::error_code ec;
  check(std::filesystem::is_regular_file(path, ec), path, ": not found or not a regular file");
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

}  // namespace meshtune
