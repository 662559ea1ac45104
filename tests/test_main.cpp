// main() of every test executable: OpenBLAS' kernel family chosen as the command line chooses it
// (src/backend/cpu/blas_kernels.h), so that a test's own products and the meshtune runs it starts
// take the same kernels — and the same cached routes — and give the same numbers.
#include <gtest/gtest.h>

#include "backend/cpu/blas_kernels.h"
#include "test_util.h"

int main(int argc, char** argv) {
  if (meshtune::time_sgemm_if_asked()) return 0;
  meshtune::choose_blas_kernels(argv);
#ifdef MESHTUNE_GPU_TESTS
  return meshtune::testing::run_gpu_tests(argc, argv);  // 77 (skipped) without a GPU
#else
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
#endif
}
