#include "backend/cpu/blas_kernels.h"

#include <cblas.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>

#include "backend/cpu/isa/features.h"
#include "core/machine_cache.h"

extern char** environ;

namespace meshtune {
namespace {

// The timed product: x·Wᵀ at a prefill/training shape, the kind sgemm runs for the model.
constexpr int kRows = 256, kCols = 2048, kDepth = 2048;

bool same_core(const std::string& a, const std::string& b) { return strcasecmp(a.c_str(), b.c_str()) == 0; }

// OpenBLAS' configuration without the core name (which changes with OPENBLAS_CORETYPE): the version
// and build options the measurement depends on.
std::string openblas_build() {
  std::string config = openblas_get_config();
  const std::string core = openblas_get_corename();
  if (const size_t at = config.find(core); !core.empty() && at != std::string::npos) config.erase(at, core.size());
  return config;
}

// Runs argv with the environment changed (`set`: "NAME=value"; `unset`: names), stdout and stderr
// captured, at most `timeout_s` seconds (then killed). The output, or nothing when it failed.
std::optional<std::string> run_child(const std::vector<std::string>& argv, const std::vector<std::string>& set,
                                     const std::vector<std::string>& unset, int timeout_s) {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string entry = *e, name = entry.substr(0, entry.find('='));
    if (std::find(unset.begin(), unset.end(), name) != unset.end()) continue;
    bool replaced = false;
    for (const std::string& s : set) replaced = replaced || s.substr(0, s.find('=')) == name;
    if (!replaced) env.push_back(entry);
  }
  env.insert(env.end(), set.begin(), set.end());
  std::vector<char*> envp, args;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (std::string& a : argv_copy) args.push_back(a.data());
  args.push_back(nullptr);

  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return std::nullopt;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], 1);  // dup2 clears close-on-exec
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], 2);
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  if (spawned != 0) {
    close(pipe_fds[0]);
    return std::nullopt;
  }
  std::string output;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  bool timed_out = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{pipe_fds[0], POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, int(left.count())) == 0) {
      timed_out = true;
      break;
    }
    char buffer[4096];
    const ssize_t n = read(pipe_fds[0], buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (output.size() < (1u << 16)) output.append(buffer, size_t(n));
  }
  close(pipe_fds[0]);
  if (timed_out) kill(pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (timed_out || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
  return output;
}

// One family's rate: a child started with OPENBLAS_CORETYPE=core (unset for OpenBLAS' own choice).
// Nothing when the child failed or OpenBLAS did not take that family (one it does not know).
std::optional<std::pair<std::string, double>> time_family(const std::vector<std::string>& timing_command,
                                                          const std::string& core) {
  std::vector<std::string> set = {"MESHTUNE_TIME_SGEMM=1"}, unset;
  if (core.empty()) unset.push_back("OPENBLAS_CORETYPE");
  else set.push_back("OPENBLAS_CORETYPE=" + core);
  const std::optional<std::string> output = run_child(timing_command, set, unset, 60);
  if (!output) return std::nullopt;
  std::istringstream lines(*output);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream words(line);
    std::string tag, got;
    double rate = 0;
    if (words >> tag >> got >> rate && tag == "sgemm" && rate > 0 && (core.empty() || same_core(got, core)))
      return std::make_pair(got, rate);
  }
  return std::nullopt;
}

std::string rates_text(const json& rates) {
  std::string text;
  for (const auto& [core, rate] : rates.items()) {
    char number[32];
    std::snprintf(number, sizeof number, "%.0f", rate.get<double>());
    text += (text.empty() ? "" : ", ") + core + " " + number;
  }
  return text;
}

BlasChoice choice_from(const json& cached, const std::string& where) {
  const std::string core = cached.value("core", std::string()), own = cached.value("openblas_chose", std::string());
  const std::string how = same_core(core, own) ? "OpenBLAS' own choice, measured fastest" : "measured faster than " + own + ", OpenBLAS' own choice";
  return {core, "OpenBLAS kernels: " + core + " (" + how + "; sgemm " + std::to_string(kRows) + "×" + std::to_string(kCols) +
                    "×" + std::to_string(kDepth) + " GFLOP/s: " + rates_text(cached.value("rates", json::object())) + "; " + where + ")"};
}

}  // namespace

bool time_sgemm_if_asked() {
  if (!std::getenv("MESHTUNE_TIME_SGEMM")) return false;
  std::vector<float> x(size_t(kRows) * kDepth), w(size_t(kCols) * kDepth), y(size_t(kRows) * kCols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 13) - 6) * 0.01f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = float(int(i % 11) - 5) * 0.01f;
  double best = std::numeric_limits<double>::infinity();
  for (int run = 0; run < 8; ++run) {  // the first starts OpenBLAS' threads and is not counted
    const auto t0 = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, kRows, kCols, kDepth, 1.f, x.data(), kDepth, w.data(), kDepth,
                0.f, y.data(), kCols);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (run > 0) best = std::min(best, seconds);
  }
  std::printf("sgemm %s %.2f\n", openblas_get_corename(), 2.0 * kRows * kCols * kDepth / best / 1e9);
  std::fflush(stdout);
  return true;
}

BlasChoice blas_kernels_to_use(const std::vector<std::string>& timing_command) {
  const std::string own = openblas_get_corename();
  const std::string key = "blas kernels v1; cpu " + cpu_identity() + "; " + openblas_build() + " choosing " + own;
  const bool recalibrate = recalibration_asked();
  auto cached_choice = [&](const std::string& by) -> std::optional<BlasChoice> {
    const std::optional<json> cached = recalibrate ? std::nullopt : read_machine_cache("blas-kernels", key);
    if (!cached) return std::nullopt;
    return choice_from(*cached, "measured " + cached->value("measured", std::string("?")) + by + ", cached in " +
                                    machine_cache_path("blas-kernels", key));
  };
  if (auto choice = cached_choice("")) return *choice;
  const MachineCacheLock lock("blas-kernels");  // one process measures, the others wait and read
  if (auto choice = cached_choice(" by another process")) return *choice;

  // OpenBLAS' own choice, and the families this CPU runs (Cooperlake's sgemm is SkylakeX's).
  std::vector<std::string> families = {""};
  if (cpu_supports(CpuPath::Avx512) && !same_core(own, "SkylakeX")) families.push_back("SkylakeX");
  if (cpu_supports(CpuPath::Avx2) && !same_core(own, "Haswell")) families.push_back("Haswell");
  json rates = json::object();
  std::string best;
  double best_rate = 0, own_rate = 0;
  for (const std::string& core : families) {
    const auto measured = time_family(timing_command, core);
    if (!measured) continue;
    rates[measured->first] = measured->second;
    if (core.empty()) own_rate = measured->second;
    if (measured->second > best_rate) best = measured->first, best_rate = measured->second;
  }
  if (own_rate == 0) return {"", "OpenBLAS kernels: " + own + " (OpenBLAS' own choice; not measured: the timing run failed)"};
  // Another family only when clearly faster: families that share their sgemm kernels (SkylakeX,
  // Cooperlake) time up to ~5 % apart; the gaps worth a change are 1.5× (Haswell) and more.
  json cached = {{"core", best_rate > 1.10 * own_rate ? best : own}, {"openblas_chose", own}, {"rates", rates}};
  const std::string saved = write_machine_cache("blas-kernels", key, cached);
  return choice_from(cached, "measured now, " + saved);
}

void choose_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE")) return;  // the user's choice, or ours before this exec
  const BlasChoice choice = blas_kernels_to_use({"/proc/self/exe"});
  setenv("MESHTUNE_BLAS_NOTE", choice.note.c_str(), 1);
  if (choice.core.empty()) return;
  setenv("OPENBLAS_CORETYPE", choice.core.c_str(), 1);  // inherited: child processes do not measure again
  if (same_core(choice.core, openblas_get_corename())) return;
  execv("/proc/self/exe", argv);  // only returns on failure: then carry on with OpenBLAS' own kernels
  unsetenv("OPENBLAS_CORETYPE");
  setenv("MESHTUNE_BLAS_NOTE", ("OpenBLAS kernels: " + std::string(openblas_get_corename()) +
                                " (OpenBLAS' own choice: re-executing with " + choice.core + " failed)").c_str(), 1);
}

std::string blas_kernel_choice() {
  const std::string core = openblas_get_corename();
  const char* note = std::getenv("MESHTUNE_BLAS_NOTE");
  const char* named = std::getenv("OPENBLAS_CORETYPE");
  // The note describes this process only when the family it names is the one OpenBLAS loaded.
  if (note && (!named || same_core(named, core))) return note;
  if (named) return "OpenBLAS kernels: " + core + " (OPENBLAS_CORETYPE=" + named + " set before the start)";
  return "OpenBLAS kernels: " + core + " (OpenBLAS' own choice; not measured in this process)";
}

}  // namespace meshtune
