#include "run_stats.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

namespace meshtune::bench {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double peak_rss_gib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) * 1024.0 / double(1 << 30);  // ru_maxrss is in KiB on Linux
}

CpuTimes cpu_times() {
  CpuTimes t;
  std::ifstream stat("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  t.all_busy_s = (user + nice + system + irq + softirq + steal) / double(sysconf(_SC_CLK_TCK));
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  t.self_s = double(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) + 1e-6 * double(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
  return t;
}

double foreign_cpus(const CpuTimes& a, const CpuTimes& b) {
  const double wall = std::chrono::duration<double>(b.at - a.at).count();
  return std::max(0.0, ((b.all_busy_s - a.all_busy_s) - (b.self_s - a.self_s)) / wall);
}

}  // namespace meshtune::bench
