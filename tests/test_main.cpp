// main() of every test executable: OpenBLAS' kernel family chosen as the command line chooses it
// (src/backend/cpu/blas_kernels.h), so that a test's own products and the meshtune runs it starts
// take the same kernels — and the same cached routes — and give the same numbers.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "backend/cpu/blas_kernels.h"
#include "test_util.h"

int main(int argc, char** argv) {
  // --setenv=NAME=VALUE: how ctest's discovered tests get more than one variable (CMake 3.25's
  // gtest_discover_tests keeps only the first of a list-valued ENVIRONMENT property).
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t equals = arg.find('=', 9);
    if (arg.rfind("--setenv=", 0) == 0 && equals != std::string::npos)
      setenv(arg.substr(9, equals - 9).c_str(), arg.substr(equals + 1).c_str(), 1);
  }
  if (meshtune::time_sgemm_if_asked()) return 0;
  meshtune::choose_blas_kernels(argv);
#ifdef MESHTUNE_GPU_TESTS
  return meshtune::testing::run_gpu_tests(argc, argv);  // 77 (skipped) without a GPU
#else
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
#endif
}
