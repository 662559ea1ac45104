#include "core/memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace meshtune {

namespace {

// A number of bytes from the first line of `path` ("max" or unreadable: none).
double limit_in_file(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return 0;
  try {
    const double v = std::stod(text);
    return v > 0 && v < 1e18 ? v : 0;  // cgroup v1 says "no limit" with a huge number
  } catch (...) {
    return 0;
  }
}

}  // namespace

MemoryLimit memory_limit() {
  MemoryLimit limit{double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE)), "physical memory"};
  auto consider = [&](double bytes, const char* source) {
    if (bytes > 0 && bytes < limit.bytes) limit = {bytes, source};
  };
  struct rlimit as;
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) consider(double(as.rlim_cur), "ulimit -v");
  consider(limit_in_file("/sys/fs/cgroup/memory.max"), "the cgroup limit");
  consider(limit_in_file("/sys/fs/cgroup/memory/memory.limit_in_bytes"), "the cgroup limit");
  return limit;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  char text[64];
  std::snprintf(text, sizeof(text), "%.2f %s", bytes, units[u]);
  return text;
}

}  // namespace meshtune
