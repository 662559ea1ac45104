#include "kernels/rmsnorm.h"

#include <cmath>

namespace meshtune {

void rmsnorm(const float* x, const float* scale, int64_t rows, int64_t dim, float eps, float* y) {
#pragma omp parallel for schedule(static) if (rows * dim > 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    float sum_sq = 0;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < dim; ++i) sum_sq += xr[i] * xr[i];
    float inv = 1.f / std::sqrt(sum_sq / float(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = (xr[i] * inv) * (1.f + scale[i]);
  }
}

}  // namespace meshtune
