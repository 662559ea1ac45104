#include "kernels/rmsnorm.h"

#include <cmath>
#include <vector>

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

// With r = rsqrt(mean(x²) + eps) and w = 1 + scale:
//   dx_i = r·w_i·dy_i − r³/dim · x_i · Σ_j dy_j·w_j·x_j,   dscale_i += Σ_rows dy_i·x_i·r.
// dx may alias dy, so each row reads all of dy (dot product, dscale) before writing dx.
void rmsnorm_backward(const float* x, const float* scale, int64_t rows, int64_t dim, float eps, const float* dy,
                      float* dx, float* dscale) {
#pragma omp parallel if (rows * dim > 32768)
  {
    // Each thread sums its rows' dscale privately; the totals are added once at the end.
    std::vector<float> local_dscale(dscale ? static_cast<size_t>(dim) : 0, 0.f);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * dim;
      const float* dyr = dy + r * dim;
      float* dxr = dx + r * dim;
      float sum_sq = 0;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < dim; ++i) sum_sq += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(sum_sq / float(dim) + eps);
      float dot = 0;  // Σ dy·w·x
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < dim; ++i) dot += dyr[i] * (1.f + scale[i]) * xr[i];
      if (dscale)
        for (int64_t i = 0; i < dim; ++i) local_dscale[i] += dyr[i] * xr[i] * inv;
      const float coef = inv * inv * inv * dot / float(dim);
      for (int64_t i = 0; i < dim; ++i) dxr[i] = inv * (1.f + scale[i]) * dyr[i] - coef * xr[i];
    }
    if (dscale) {
#pragma omp critical
      for (int64_t i = 0; i < dim; ++i) dscale[i] += local_dscale[i];
    }
  }
}

}  // namespace meshtune
