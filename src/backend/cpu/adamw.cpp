#include "backend/cpu/adamw.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/kernel_path.h"

namespace meshtune {

void adamw_update(const KernelPath& path, float* theta, const float* grad, float* m, float* v, int64_t n, const AdamWStep& step) {
  const cpu::VectorOps& ops = path.ops();
#pragma omp parallel for schedule(static) if (n > 4 * cpu::kElementsPerCall)
  for (int64_t begin = 0; begin < n; begin += cpu::kElementsPerCall) {
    const int64_t len = std::min(cpu::kElementsPerCall, n - begin);
    ops.adamw(theta + begin, grad + begin, m + begin, v + begin, len, step);
  }
}

constexpr int64_t kBlock = 1 << 16;

double sum_of_squares(const float* x, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> sums(static_cast<size_t>(blocks), 0.0);
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    double sum = 0;
    for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) sum += double(x[i]) * double(x[i]);
    sums[size_t(b)] = sum;
  }
  double total = 0;
  for (double s : sums) total += s;
  return total;
}

void scale_by_ratio(float* x, int64_t n, float numerator, float denominator) {
#pragma omp parallel for simd schedule(static) if (n > kBlock)
  for (int64_t i = 0; i < n; ++i) x[i] = (x[i] * numerator) / denominator;
}

void clamp_values(float* x, int64_t n, float limit) {
#pragma omp parallel for simd schedule(static) if (n > kBlock)
  for (int64_t i = 0; i < n; ++i) x[i] = std::clamp(x[i], -limit, limit);
}

bool all_finite(const float* x, int64_t n) {
  int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad) if (n > kBlock)
  for (int64_t i = 0; i < n; ++i) bad += std::isfinite(x[i]) ? 0 : 1;
  return bad == 0;
}

}  // namespace meshtune
