#include "backend/cpu/rmsnorm.h"

#include <cstddef>
#include <vector>


namespace meshtune {

void rmsnorm(const KernelPath& path, const float* x, const float* scale, int64_t rows, int64_t dim, float eps, float* y) {
  const cpu::VectorOps& ops = path.ops();
#pragma omp parallel for schedule(static) if (rows * dim > 32768)
  for (int64_t r = 0; r < rows; ++r) ops.rmsnorm_row(x + r * dim, scale, dim, eps, y + r * dim);
}

void rmsnorm_backward(const KernelPath& path, const float* x, const float* scale, int64_t rows, int64_t dim, float eps, const float* dy,
                      float* dx, float* dscale) {
  const cpu::VectorOps& ops = path.ops();
#pragma omp parallel if (rows * dim > 32768)
  {
    // Each thread sums its rows' dscale privately; the totals are added once at the end.
    std::vector<float> local_dscale(dscale ? static_cast<size_t>(dim) : 0, 0.f);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      ops.rmsnorm_backward_row(x + r * dim, scale, dim, eps, dy + r * dim, dx + r * dim,
                               dscale ? local_dscale.data() : nullptr);
    if (dscale) {
#pragma omp critical
      for (int64_t i = 0; i < dim; ++i) dscale[i] += local_dscale[i];
    }
  }
}

}  // namespace meshtune
