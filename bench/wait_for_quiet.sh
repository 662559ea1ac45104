# Shared by the benchmark scripts (sourced): waiting for an idle machine before each measurement.
# BENCH_NAME names the script in messages.

# Busy CPUs (all processes) over one second, from /proc/stat, in clock ticks.
busy_cpus() {
  local a b
  a=($(head -n 1 /proc/stat))
  sleep 1
  b=($(head -n 1 /proc/stat))
  echo $(( (b[1] + b[2] + b[3] + b[6] + b[7] + b[8]) - (a[1] + a[2] + a[3] + a[6] + a[7] + a[8]) ))
}

# Waits (up to 20 min) while an inference benchmark (bench_inference, ./bw) runs, then (up to
# 5 min) until other processes keep less than half a CPU busy: every number assumes that the run
# has both cores to itself. Runs anyway after that; the JSON's foreign_cpus tells.
wait_for_quiet() {
  local waited=0
  while pgrep -f "bench_inference|/bw " > /dev/null && [ "$waited" -lt 1200 ]; do
    [ "$waited" -eq 0 ] && echo "${BENCH_NAME:-bench}: waiting for a running inference benchmark to finish" >&2
    sleep 30
    waited=$((waited + 30))
  done
  waited=0
  while [ "$(busy_cpus)" -gt $(( $(getconf CLK_TCK) / 2 )) ] && [ "$waited" -lt 300 ]; do
    [ "$waited" -eq 0 ] && echo "${BENCH_NAME:-bench}: waiting for the machine to become idle" >&2
    sleep 4
    waited=$((waited + 5))
  done
}
