// The matrix products' routes chosen by measurement (backend/cpu/routes.h): measured once and
// cached per machine, the cache honoured (a hand-edited route is taken), a damaged or unwritable
// cache never stops a run, and the variables force a route. The routes' numbers against the
// reference are test_backend_ops' ForcedRoutes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <filesystem>
#include <fstream>
#include <string>

#include "backend/cpu/isa/onednn.h"
#include "backend/cpu/routes.h"
#include "backend/cpu_backend.h"
#include "backend/reference_backend.h"
#include "core/file_util.h"
#include "core/json.h"
#include "core/machine_cache.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;

namespace {

// The routes' one cache file in `dir` (beside it: the lock, OpenBLAS' kernel family).
std::string only_cache_file(const std::string& dir) {
  std::string found;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("routes-", 0) != 0 || entry.path().extension() != ".json") continue;
    EXPECT_TRUE(found.empty()) << "a second cache file: " << entry.path();
    found = entry.path().string();
  }
  return found;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(Routes, MeasuredOnceThenReadFromTheCache) {
  const std::string dir = make_temp_dir("routes") + "/cache";  // does not exist yet: made
  const std::string env = "MESHTUNE_CACHE_DIR=" + dir;
  const CommandResult first = run_meshtune("info --system", env);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  EXPECT_TRUE(contains(first.out, "measured now")) << first.out;
  const std::string file = only_cache_file(dir);
  ASSERT_FALSE(file.empty());
  EXPECT_TRUE(contains(first.out, "saved in " + file)) << first.out;

  const CommandResult second = run_meshtune("info --system", env);
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_TRUE(contains(second.out, "cached in " + file)) << second.out;

  // A route changed in the file is the route taken: the cache is what decides.
  json cache = parse_json(read_file(file), file);
  json& f32 = cache["products"]["f32 x·Wᵀ"];
  const bool was_onednn = f32["route"] == "onednn";
  if (!was_onednn && f32["onednn_gflops"].get<double>() == 0) GTEST_SKIP() << "oneDNN is not a candidate here";
  f32["route"] = was_onednn ? "own" : "onednn";
  write_file_atomic(file, cache.dump());
  const CommandResult edited = run_meshtune("info --system", env);
  ASSERT_EQ(edited.exit_code, 0) << edited.err;
  EXPECT_TRUE(contains(edited.out, was_onednn ? "  f32 x·Wᵀ: OpenBLAS sgemm — measured" : "  f32 x·Wᵀ: oneDNN — measured"))
      << edited.out;

  // Asked to measure again (the variable, the flag): measured and saved over the file.
  for (const std::string& again : {std::string("info --system --recalibrate"), std::string("info --system")}) {
    const CommandResult r = run_meshtune(again, env + (again == "info --system" ? " MESHTUNE_RECALIBRATE=1" : ""));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(contains(r.out, "measured now")) << again << "\n" << r.out;
    EXPECT_EQ(only_cache_file(dir), file);
  }
}

TEST(Routes, ADamagedOrUnwritableCacheIsMeasuredAgain) {
  const std::string dir = make_temp_dir("routes-damaged");
  const std::string env = "MESHTUNE_CACHE_DIR=" + dir;
  ASSERT_EQ(run_meshtune("info --system", env).exit_code, 0);
  const std::string file = only_cache_file(dir);
  for (const std::string& damage : {std::string("{\"key\": 1"), std::string("")}) {
    std::ofstream(file) << damage;
    const CommandResult r = run_meshtune("info --system", env);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(contains(r.out, "measured now")) << r.out;
    EXPECT_NO_THROW(parse_json(read_file(file), file));  // written again, whole
  }
  // A cache directory that cannot be made: the run measures and goes on, and says so.
  const CommandResult r = run_meshtune("info --system", "MESHTUNE_CACHE_DIR=" + file + "/under-a-file");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "measured now, not cached: ")) << r.out;
}

// A product of 1 GFLOP or more gets its route measured at its own shape, once: both routes timed,
// the choice kept (a second product of the shape measures nothing) and saved in the cache; the
// result is the product's either way.
TEST(Routes, LargeProductsAreMeasuredAtTheirOwnShape) {
  const std::string dir = make_temp_dir("routes-shape");
  setenv("MESHTUNE_CACHE_DIR", dir.c_str(), 1);  // this process' first use of the routes
  CpuBackend backend;
  const int64_t M = 100, rows = 4096, cols = 1500;  // 2·M·rows·cols = 1.2 GFLOP; M's bucket is 128
  ASSERT_GE(2.0 * M * rows * cols, kShapeRouteFlops);
  const std::vector<float> x = random_vector(size_t(M * cols), 1), w = random_vector(size_t(rows * cols), 2);
  const WeightMatrix W = WeightMatrix::from_f32(rows, cols, w);
  std::vector<float> y(size_t(M * rows)), want(y.size());
  backend.linear(x, M, W, y, MatmulPrecision::F32);
  const std::string name = "f32 x·Wᵀ at 128 × 4096 × 1500";
  const MeasuredRoutes& routes = measured_routes();
  if (!backend.path().uses_onednn(Product::F32Linear) && routes.rates[size_t(Product::F32Linear)].onednn == 0)
    GTEST_SKIP() << "oneDNN is not a candidate here";
  ASSERT_EQ(routes.shapes.count(name), 1u);
  const ShapeRoute measured = routes.shapes.at(name);
  EXPECT_GT(measured.rates.own, 0);
  EXPECT_GT(measured.rates.onednn, 0);
  EXPECT_EQ(measured.onednn, measured.rates.onednn > 1.02 * measured.rates.own);
  backend.linear(x, M, W, y, MatmulPrecision::F32);  // the same shape: nothing measured again
  EXPECT_EQ(routes.shapes.at(name).rates.own, measured.rates.own);
  ReferenceBackend().linear(x, M, W, want, MatmulPrecision::F32);
  for (size_t i = 0; i < y.size(); i += 97) ASSERT_NEAR(y[i], want[i], 1e-3f) << i;
  const json cache = parse_json(read_file(only_cache_file(dir)), dir);
  EXPECT_EQ(cache.at("shapes").at(name).at("route"), measured.onednn ? "onednn" : "own");
}

// A shape another process measured (an MPI rank beside this one) is read from the cache, not timed
// again, so the processes of a job take the same route; what this process saves keeps it.
TEST(Routes, AShapeAnotherProcessMeasuredIsTaken) {
  const std::string dir = make_temp_dir("routes-other");
  setenv("MESHTUNE_CACHE_DIR", dir.c_str(), 1);  // this process' first use of the routes
  CpuBackend backend;
  if (!backend.path().uses_onednn(Product::F32Linear) && measured_routes().rates[size_t(Product::F32Linear)].onednn == 0)
    GTEST_SKIP() << "oneDNN is not a candidate here";
  const std::string file = only_cache_file(dir), name = "f32 x·Wᵀ at 128 × 4096 × 1500";
  json cache = parse_json(read_file(file), file);  // as if another process had measured the shape
  cache["shapes"][name] = {{"own_gflops", 1.5}, {"onednn_gflops", 2.5}, {"route", "onednn"}};
  cache["shapes"]["f32 x·Wᵀ at 128 × 8192 × 1500"] = {{"own_gflops", 3.5}, {"onednn_gflops", 2.5}, {"route", "own"}};
  write_file_atomic(file, cache.dump());
  const int64_t M = 100, rows = 4096, cols = 1500;
  const WeightMatrix W = WeightMatrix::from_f32(rows, cols, random_vector(size_t(rows * cols), 2));
  std::vector<float> y(size_t(M * rows));
  backend.linear(random_vector(size_t(M * cols), 1), M, W, y, MatmulPrecision::F32);
  ASSERT_EQ(measured_routes().shapes.count(name), 1u);
  EXPECT_EQ(measured_routes().shapes.at(name).rates.own, 1.5);  // read, not timed
  EXPECT_TRUE(measured_routes().shapes.at(name).onednn);

  const std::string other = "f32 x·Wᵀ at 128 × 4096 × 1400";  // a shape nobody measured: timed and saved
  const WeightMatrix W2 = WeightMatrix::from_f32(rows, 1400, random_vector(size_t(rows * 1400), 3));
  backend.linear(random_vector(size_t(M * 1400), 4), M, W2, y, MatmulPrecision::F32);
  const json saved = parse_json(read_file(file), file);
  EXPECT_TRUE(saved.at("shapes").contains(other)) << saved.dump();
  EXPECT_EQ(saved.at("shapes").at("f32 x·Wᵀ at 128 × 8192 × 1500").at("own_gflops"), 3.5);  // kept
}

// The lock processes measuring at once take: the second waits until the first lets go.
TEST(Routes, MeasuringProcessesWaitForEachOther) {
  const std::string dir = make_temp_dir("routes-lock");
  setenv("MESHTUNE_CACHE_DIR", dir.c_str(), 1);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const MachineCacheLock lock("routes");
    char byte = 1;
    if (write(ready[1], &byte, 1) != 1) _exit(2);
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    _exit(0);
  }
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);  // the child holds the lock
  const auto t0 = std::chrono::steady_clock::now();
  { const MachineCacheLock lock("routes"); }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_GT(waited, 0.2);
  close(ready[0]);
  close(ready[1]);
}

TEST(Routes, VariablesForceARouteAndABadValueIsAnError) {
  const CommandResult sgemm = run_meshtune("info --system", "MESHTUNE_F32_MATMUL=sgemm MESHTUNE_INT8_MATMUL=meshtune");
  ASSERT_EQ(sgemm.exit_code, 0) << sgemm.err;
  for (const char* line : {"  f32 x·Wᵀ: OpenBLAS sgemm", "  f32 dy·W: OpenBLAS sgemm", "  f32 dyᵀ·x: OpenBLAS sgemm",
                           "  int8 x·Wᵀ: meshtune"})
    EXPECT_TRUE(contains(sgemm.out, line)) << line << "\n" << sgemm.out;
  if (cpu::onednn_available()) {
    const CommandResult onednn = run_meshtune("info --system", "MESHTUNE_F32_MATMUL=onednn");
    ASSERT_EQ(onednn.exit_code, 0) << onednn.err;
    EXPECT_TRUE(contains(onednn.out, "  f32 dyᵀ·x: oneDNN")) << onednn.out;
  }
  for (const auto& [env, message] : {std::pair<std::string, std::string>{"MESHTUNE_F32_MATMUL=mkl", "MESHTUNE_F32_MATMUL=mkl: expected onednn or sgemm"},
                                     {"MESHTUNE_INT8_MATMUL=sgemm", "MESHTUNE_INT8_MATMUL=sgemm: expected onednn or meshtune"}}) {
    const CommandResult bad = run_meshtune("info --system", env);
    EXPECT_EQ(bad.exit_code, 1) << bad.err;
    EXPECT_TRUE(contains(bad.err, message)) << bad.err;
  }
  const CommandResult flag = run_meshtune("info --recalibrate");
  EXPECT_EQ(flag.exit_code, 1);
  EXPECT_TRUE(contains(flag.err, "--recalibrate needs --system")) << flag.err;
}

}  // namespace
