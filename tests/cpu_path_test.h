// A fixture for tests that run once per CPU path (backend/cpu/isa/features.h): each instance makes
// its own CpuBackend on its path (the path is the backend's, not the process'); a path this CPU
// lacks is skipped (and says so).
#pragma once
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "backend/cpu_backend.h"

namespace meshtune::testing {

// A CpuBackend on `isa` (the CPU must support it), with the products' measured routes unless told
// otherwise.
inline std::unique_ptr<CpuBackend> cpu_backend_on(CpuPath isa, bool onednn_int8 = true,
                                                  std::optional<bool> onednn_bf16 = std::nullopt) {
  CpuBackendOptions options;
  options.isa = isa;
  if (!onednn_int8) options.force({Product::Int8Linear}, false);
  if (onednn_bf16) options.force({Product::Bf16Linear, Product::Bf16InputGradient}, *onednn_bf16);
  return std::make_unique<CpuBackend>(options);
}

class CpuPathTest : public ::testing::TestWithParam<CpuPath> {
 protected:
  void SetUp() override {
    if (!cpu_supports(GetParam())) GTEST_SKIP() << "this CPU has no " << cpu_path_name(GetParam()) << " path";
    backend_ = cpu_backend_on(GetParam());
  }
  CpuBackend& backend() { return *backend_; }
  const KernelPath& path() const { return backend_->path(); }

 private:
  std::unique_ptr<CpuBackend> backend_;
};

// INSTANTIATE_TEST_SUITE_P(CpuPaths, Suite, kEveryCpuPath, cpu_path_test_name);
inline const auto kEveryCpuPath =
    ::testing::Values(CpuPath::Generic, CpuPath::Avx2, CpuPath::Avx512, CpuPath::Avx512Bf16);
inline std::string cpu_path_test_name(const ::testing::TestParamInfo<CpuPath>& info) {
  return cpu_path_name(info.param);
}

}  // namespace meshtune::testing
