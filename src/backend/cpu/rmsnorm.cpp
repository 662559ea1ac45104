#include "backend/cpu/rmsnorm.h"

#include <omp.h>

#include <cstddef>
#include <vector>


namespace meshtune {

void rmsnorm(const KernelPath& path, const float* x, const float* scale, int64_t rows, int64_t dim, float eps, float* y) {
  const cpu::VectorOps& ops = path.ops();
#pragma omp parallel for schedule(static) if (rows * dim > 32768)
  for (int64_t r = 0; r < rows; ++r) ops.rmsnorm_row(x + r * dim, scale, dim, eps, y + r * dim);
}

void rmsnorm_backward(const KernelPath& path, const float* x, const float* scale, int64_t rows, int64_t dim, float eps, const float* dy,
                      float* dx, float* dscale, bool accumulate) {
  const cpu::VectorOps& ops = path.ops();
  const bool parallel = rows * dim > 32768;
  // Each thread sums its rows' dscale privately; the parts are added in thread order at the end, so
  // that the result does not depend on which thread finishes first.
  std::vector<float> parts(dscale ? size_t(parallel ? omp_get_max_threads() : 1) * size_t(dim) : 0, 0.f);
  int threads = 1;
#pragma omp parallel if (parallel)
  {
#pragma omp single
    threads = omp_get_num_threads();
    float* part = dscale ? parts.data() + size_t(omp_get_thread_num()) * size_t(dim) : nullptr;
    std::vector<float> row(accumulate ? size_t(dim) : 0);  // a row's gradient before it is added
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      ops.rmsnorm_backward_row(x + r * dim, scale, dim, eps, dy + r * dim, accumulate ? row.data() : dx + r * dim, part);
      if (accumulate) ops.axpy(1.f, row.data(), dx + r * dim, dim);  // dx + 1·row: exactly dx + row
    }
  }
  if (dscale)
    for (int t = 0; t < threads; ++t)
      for (int64_t i = 0; i < dim; ++i) dscale[i] += parts[size_t(t) * size_t(dim) + size_t(i)];
}

}  // namespace meshtune
