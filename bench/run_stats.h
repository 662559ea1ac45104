// What every benchmark measures about its own run: medians, peak RSS, and how much CPU other
// processes took meanwhile (the machine may be shared; a busy neighbour halves both the bandwidth
// and the GEMM rate, so each JSON line reports it as foreign_cpus).
#pragma once
#include <chrono>
#include <vector>

namespace meshtune::bench {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0);
double median(std::vector<double> v);
double peak_rss_gib();  // this process' peak resident set so far

// Busy CPU seconds of the whole machine (/proc/stat) and of this process (getrusage) at a moment.
struct CpuTimes {
  double all_busy_s = 0, self_s = 0;
  Clock::time_point at = Clock::now();
};
CpuTimes cpu_times();
// Average number of CPUs kept busy by other processes between a and b.
double foreign_cpus(const CpuTimes& a, const CpuTimes& b);

}  // namespace meshtune::bench
