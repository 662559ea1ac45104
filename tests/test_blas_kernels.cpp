// OpenBLAS' kernel family chosen by measurement (backend/cpu/blas_kernels.h): every family this CPU
// runs is timed once and cached, the fastest is the one the program then runs (it re-executes with
// OPENBLAS_CORETYPE), the cache decides, and a user's OPENBLAS_CORETYPE is kept.
#include <gtest/gtest.h>
#include <strings.h>

#include <filesystem>
#include <string>

#include "backend/cpu/isa/features.h"
#include "core/file_util.h"
#include "core/json.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;

namespace {

// The test process itself runs the chosen family (tests/test_main.cpp): its children start without
// that choice, as a user's first run does.
const std::string kFresh = "env -u OPENBLAS_CORETYPE -u MESHTUNE_BLAS_NOTE ";

std::string blas_cache_file(const std::string& dir) {
  std::string found;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().filename().string().rfind("blas-kernels-", 0) == 0) {
      EXPECT_TRUE(found.empty()) << "a second cache file: " << entry.path();
      found = entry.path().string();
    }
  return found;
}

// From `info --system`: the family the note names and the one OpenBLAS reports it loaded.
std::string line_after(const std::string& text, const std::string& start, const std::string& end) {
  const size_t at = text.find(start);
  if (at == std::string::npos) return "";
  const size_t from = at + start.size();
  return text.substr(from, text.find_first_of(end, from) - from);
}
std::string chosen_family(const std::string& info) { return line_after(info, "OpenBLAS kernels: ", " "); }
std::string loaded_family(const std::string& info) { return line_after(info, ", core ", ","); }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
bool same(const std::string& a, const std::string& b) { return strcasecmp(a.c_str(), b.c_str()) == 0; }

TEST(BlasKernels, EveryFamilyTimedOnceAndTheFastestRun) {
  const std::string dir = make_temp_dir("blas") + "/cache";
  const std::string env = "MESHTUNE_CACHE_DIR=" + dir;
  const CommandResult first = run_meshtune("info --system", env, kFresh);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  EXPECT_TRUE(contains(first.out, "measured now")) << first.out;
  const std::string file = blas_cache_file(dir);
  ASSERT_FALSE(file.empty()) << first.out;
  const json cache = parse_json(read_file(file), file);
  const json& rates = cache.at("rates");
  // OpenBLAS' own family and every one this CPU runs were timed.
  auto timed = [&](const std::string& family) {
    for (const auto& [name, rate] : rates.items())
      if (same(name, family)) return rate.get<double>() > 0;
    return false;
  };
  EXPECT_TRUE(timed(cache.at("openblas_chose").get<std::string>())) << cache.dump();
  if (cpu_supports(CpuPath::Avx512)) EXPECT_TRUE(timed("SkylakeX")) << cache.dump();
  if (cpu_supports(CpuPath::Avx2)) EXPECT_TRUE(timed("Haswell")) << cache.dump();
  // The choice: the fastest, unless OpenBLAS' own is within 10 % of it.
  std::string fastest;
  double best = 0;
  for (const auto& [name, rate] : rates.items())
    if (rate.get<double>() > best) fastest = name, best = rate.get<double>();
  const std::string own = cache.at("openblas_chose").get<std::string>(), chosen = cache.at("core").get<std::string>();
  EXPECT_TRUE(same(chosen, best > 1.10 * rates.at(own).get<double>() ? fastest : own)) << cache.dump();
  // The run took it: OpenBLAS reports the family the note names.
  EXPECT_TRUE(same(chosen_family(first.out), chosen)) << first.out;
  EXPECT_TRUE(same(loaded_family(first.out), chosen)) << first.out;

  const CommandResult second = run_meshtune("info --system", env, kFresh);
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_TRUE(contains(second.out, "cached in " + file)) << second.out;
  EXPECT_TRUE(same(loaded_family(second.out), chosen)) << second.out;

  const CommandResult again = run_meshtune("info --system", env + " MESHTUNE_RECALIBRATE=1", kFresh);
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_TRUE(contains(again.out, "OpenBLAS kernels: ") && contains(again.out, "measured now")) << again.out;
  EXPECT_EQ(blas_cache_file(dir), file);
}

// The family in the cache is the family run, whichever it is: the re-execution really loads it.
TEST(BlasKernels, TheCacheDecides) {
  const std::string dir = make_temp_dir("blas-edited");
  const std::string env = "MESHTUNE_CACHE_DIR=" + dir;
  ASSERT_EQ(run_meshtune("info --system", env, kFresh).exit_code, 0);
  const std::string file = blas_cache_file(dir);
  ASSERT_FALSE(file.empty());
  json cache = parse_json(read_file(file), file);
  int families = 0;
  for (const auto& [name, rate] : cache.at("rates").items()) {
    cache["core"] = name;
    write_file_atomic(file, cache.dump());
    const CommandResult r = run_meshtune("info --system", env, kFresh);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(same(loaded_family(r.out), name)) << r.out;
    EXPECT_TRUE(same(chosen_family(r.out), name)) << r.out;
    ++families;
  }
  if (families < 2) GTEST_SKIP() << "this CPU runs one family only";
}

TEST(BlasKernels, AUsersChoiceIsKept) {
  if (!cpu_supports(CpuPath::Avx2)) GTEST_SKIP() << "no AVX2: OpenBLAS' Haswell kernels would not run";
  const std::string dir = make_temp_dir("blas-user");
  const CommandResult r = run_meshtune("info --system", "MESHTUNE_CACHE_DIR=" + dir + " OPENBLAS_CORETYPE=Haswell",
                                       "env -u MESHTUNE_BLAS_NOTE ");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "OpenBLAS kernels: Haswell (OPENBLAS_CORETYPE=Haswell set before the start)")) << r.out;
  EXPECT_TRUE(same(loaded_family(r.out), "Haswell")) << r.out;
  EXPECT_TRUE(blas_cache_file(dir).empty());  // nothing measured
}

TEST(BlasKernels, TheTimingChildPrintsItsRate) {
  const CommandResult r = run_meshtune("", "MESHTUNE_TIME_SGEMM=1", "env -u OPENBLAS_CORETYPE ");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  double rate = 0;
  char core[64] = {};
  ASSERT_EQ(std::sscanf(r.out.c_str(), "sgemm %63s %lf", core, &rate), 2) << r.out;
  EXPECT_GT(rate, 0.1);
}

}  // namespace
