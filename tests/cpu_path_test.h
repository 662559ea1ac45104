// A fixture for tests that run once per CPU path (kernels/cpu/features.h): each instance switches
// the kernels to its path and back; a path this CPU lacks is skipped (and says so).
#pragma once
#include <gtest/gtest.h>

#include <string>

#include "kernels/cpu/features.h"

namespace meshtune::testing {

class CpuPathTest : public ::testing::TestWithParam<CpuPath> {
 protected:
  void SetUp() override {
    if (!cpu_supports(GetParam())) GTEST_SKIP() << "this CPU has no " << cpu_path_name(GetParam()) << " path";
    saved_ = cpu_path();
    set_cpu_path(GetParam());
  }
  void TearDown() override {
    if (cpu_supports(GetParam())) set_cpu_path(saved_);
  }
  CpuPath saved_ = CpuPath::Generic;
};

// Switches the kernels to `path` for a scope, for tests parameterised on more than the path
// (check cpu_supports(path) first and skip).
class ScopedCpuPath {
 public:
  explicit ScopedCpuPath(CpuPath path) : saved_(cpu_path()) { set_cpu_path(path); }
  ~ScopedCpuPath() { set_cpu_path(saved_); }
  ScopedCpuPath(const ScopedCpuPath&) = delete;
  ScopedCpuPath& operator=(const ScopedCpuPath&) = delete;

 private:
  CpuPath saved_;
};

// INSTANTIATE_TEST_SUITE_P(CpuPaths, Suite, kEveryCpuPath, cpu_path_test_name);
inline const auto kEveryCpuPath =
    ::testing::Values(CpuPath::Generic, CpuPath::Avx2, CpuPath::Avx512, CpuPath::Avx512Bf16);
inline std::string cpu_path_test_name(const ::testing::TestParamInfo<CpuPath>& info) {
  return cpu_path_name(info.param);
}

}  // namespace meshtune::testing
