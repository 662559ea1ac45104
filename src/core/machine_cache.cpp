#include "core/machine_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>

#include "core/file_util.h"

namespace meshtune {

std::string cache_directory() {
  if (const char* dir = std::getenv("MESHTUNE_CACHE_DIR"); dir && *dir) return dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/meshtune";
  if (const char* home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/meshtune";
  return "/tmp/meshtune-cache";
}

std::string machine_cache_path(const std::string& kind, const std::string& key) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a: the same name in every build and run
  for (unsigned char c : key) h = (h ^ c) * 1099511628211ull;
  char hash[20];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(h));
  return cache_directory() + "/" + kind + "-" + hash + ".json";
}

std::optional<json> read_machine_cache(const std::string& kind, const std::string& key) {
  const std::string path = machine_cache_path(kind, key);
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return std::nullopt;
  try {
    json j = parse_json(read_file(path, 1 << 16), path);
    if (!j.is_object() || j.value("key", "") != key) return std::nullopt;
    return j;
  } catch (const std::exception&) {
    return std::nullopt;  // damaged: measured again
  }
}

std::string write_machine_cache(const std::string& kind, const std::string& key, json values) {
  char when[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  values["key"] = key;
  values["measured"] = when;
  const std::string path = machine_cache_path(kind, key);
  try {
    std::error_code ec;
    std::filesystem::create_directories(cache_directory(), ec);
    write_file_atomic(path, values.dump(2) + "\n");
    return "saved in " + path;
  } catch (const std::exception& e) {
    return std::string("not cached: ") + e.what();
  }
}

bool recalibration_asked() {
  const char* env = std::getenv("MESHTUNE_RECALIBRATE");
  return env && *env && std::string(env) != "0";
}

MachineCacheLock::MachineCacheLock(const std::string& kind) {
  std::error_code ec;
  std::filesystem::create_directories(cache_directory(), ec);
  fd_ = open((cache_directory() + "/" + kind + ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  if (fd_ >= 0)
    while (flock(fd_, LOCK_EX) != 0 && errno == EINTR) {}
}

MachineCacheLock::~MachineCacheLock() {
  if (fd_ >= 0) close(fd_);  // releases the lock
}

}  // namespace meshtune
