// `linear` against `linear_reference` (double accumulation) for fp32 and bf16 weights, on every
// CPU path this machine supports (generic, AVX2, AVX-512: each test runs once per path), over row
// counts that take every code path (matrix-vector for M ≤ 4, sgemm above) and shapes that are not
// multiples of the SIMD width, the row blocking or the thread split.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu_path_test.h"
#include "backend/cpu/isa/features.h"
#include "backend/cpu/linear.h"
#include "test_util.h"

namespace meshtune {
namespace {

using testing::reference_linear;

WeightMatrix random_weights(int64_t rows, int64_t cols, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  WeightMatrix w;
  w.rows = rows;
  w.cols = cols;
  w.dtype = dtype;
  const size_t n = size_t(rows) * size_t(cols);
  if (dtype == DType::F32) {
    auto data = std::shared_ptr<float[]>(new float[n]);
    for (size_t i = 0; i < n; ++i) data[i] = normal(rng);
    w.data = data.get();
    w.owner = data;
  } else {
    auto data = std::shared_ptr<uint16_t[]>(new uint16_t[n]);
    for (size_t i = 0; i < n; ++i) data[i] = f32_to_bf16(normal(rng));
    w.data = data.get();
    w.owner = data;
  }
  return w;
}

std::vector<float> random_input(int64_t M, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(M * cols));
  for (float& v : x) v = normal(rng);
  return x;
}

// Every y[m, r] must be within `tol` of the reference, relative to Σ_k |x[m,k]·W[r,k]| (the scale
// of the rounding error of any summation order; a bare |y| can be near zero by cancellation).
// bf16 weights are widened exactly, so they get the same fp32 tolerance.
void expect_matches_reference(const KernelPath& path, int64_t M, int64_t rows, int64_t cols, DType dtype, double tol = 1e-5) {
  SCOPED_TRACE("M=" + std::to_string(M) + " rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
               " dtype=" + dtype_name(dtype));
  const WeightMatrix w = random_weights(rows, cols, dtype, uint32_t(rows * 1000 + cols));
  const std::vector<float> x = random_input(M, cols, uint32_t(M * 7 + cols));
  std::vector<float> y(static_cast<size_t>(M * rows), NAN), ref(static_cast<size_t>(M * rows));
  linear(path, x.data(), M, w, y.data());
  reference_linear(x.data(), M, w, ref.data());
  int failures = 0;
  for (int64_t m = 0; m < M && failures < 5; ++m)
    for (int64_t r = 0; r < rows && failures < 5; ++r) {
      double scale = 0;
      for (int64_t c = 0; c < cols; ++c) scale += std::abs(double(x[m * cols + c]) * w.at(r, c));
      const double got = y[m * rows + r], want = ref[m * rows + r];
      if (!(std::abs(got - want) <= tol * scale + 1e-30)) {
        ADD_FAILURE() << "y[" << m << ", " << r << "] = " << got << ", reference " << want << " (scale " << scale << ")";
        ++failures;
      }
    }
}

// Each test runs once per CPU path; a path this CPU lacks is skipped (and says so).
class Linear : public testing::CpuPathTest {};

const int64_t kRowCounts[] = {1, 2, 3, 4, 5, 7, 33, 130};
const int64_t kDims[] = {1, 3, 17, 61, 100, 257};

TEST_P(Linear, F32OddShapes) {
  for (int64_t M : kRowCounts)
    for (int64_t rows : kDims)
      for (int64_t cols : kDims) expect_matches_reference(path(), M, rows, cols, DType::F32);
}

TEST_P(Linear, Bf16OddShapes) {
  for (int64_t M : kRowCounts)
    for (int64_t rows : kDims)
      for (int64_t cols : kDims) expect_matches_reference(path(), M, rows, cols, DType::BF16);
}

// Shapes large enough to cross the bf16 widening blocks and give each thread several row blocks,
// with dimensions that are not multiples of the SIMD width or the block sizes.
TEST_P(Linear, LargerShapesCrossBlocks) {
  for (DType dtype : {DType::F32, DType::BF16})
    for (int64_t M : {1, 3, 4, 5, 130}) {
      expect_matches_reference(path(), M, 1027, 2049, dtype);
      expect_matches_reference(path(), M, 3001, 67, dtype);
    }
}

// Any thread count gives the same answer (the split of rows between threads must not drop or
// double rows), including more threads than rows.
TEST_P(Linear, ThreadCounts) {
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3, 8}) {
    SCOPED_TRACE("threads=" + std::to_string(threads));
    omp_set_num_threads(threads);
    for (DType dtype : {DType::F32, DType::BF16})
      for (int64_t M : {1, 2, 4, 7})
        for (int64_t rows : {1, 5, 61, 257}) expect_matches_reference(path(), M, rows, 100, dtype);
  }
  omp_set_num_threads(saved);
}

// Calling `linear` from inside a parallel region (nested use) still computes every row.
TEST_P(Linear, InsideParallelRegion) {
  const WeightMatrix w = random_weights(61, 257, DType::BF16, 5);
  const std::vector<float> x = random_input(5, 257, 6);
  std::vector<float> ref(5 * 61);
  reference_linear(x.data(), 5, w, ref.data());
  std::vector<std::vector<float>> ys(2, std::vector<float>(5 * 61, NAN));
#pragma omp parallel for num_threads(2)
  for (int i = 0; i < 2; ++i) linear(path(), x.data(), i == 0 ? 1 : 5, w, ys[size_t(i)].data());
  for (int64_t r = 0; r < 61; ++r) EXPECT_NEAR(ys[0][size_t(r)], ref[size_t(r)], 1e-4);
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(ys[1][i], ref[i], 1e-4);
}

TEST_P(Linear, WideningMatchesTheScalarConversion) {
  std::vector<uint16_t> bits(1003);
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = uint16_t(i * 977 + 13);  // every exponent, signs, NaNs
  std::vector<float> wide(bits.size(), -1.f);
  widen_bf16(path(), bits.data(), int64_t(bits.size()), wide.data());
  for (size_t i = 0; i < bits.size(); ++i) {
    const float want = bf16_to_f32(bits[i]);
    if (std::isnan(want)) EXPECT_TRUE(std::isnan(wide[i])) << i;
    else EXPECT_EQ(wide[i], want) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(CpuPaths, Linear, testing::kEveryCpuPath, testing::cpu_path_test_name);

}  // namespace
}  // namespace meshtune
