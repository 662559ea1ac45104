// How much memory this process may use: the smallest of its address-space limit (ulimit -v), its
// cgroup's memory limit (containers, batch schedulers) and the machine's physical memory. Checked
// against an estimate before a large allocation, so that a run too big for the machine fails at
// once with one line instead of dying later with "out of memory".
#pragma once
#include <string>

namespace meshtune {

struct MemoryLimit {
  double bytes = 0;
  std::string source;  // "physical memory", "ulimit -v", "the cgroup limit"
};
MemoryLimit memory_limit();

// "1.50 GiB", "512.00 MiB": bytes in binary units with two decimals.
std::string format_bytes(double bytes);

}  // namespace meshtune
