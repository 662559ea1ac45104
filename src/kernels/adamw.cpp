#include "kernels/adamw.h"

#include <algorithm>

#include "kernels/cpu/vector_ops.h"

namespace meshtune {

void adamw_update(float* theta, const float* grad, float* m, float* v, int64_t n, const AdamWStep& step) {
  const cpu::VectorOps& ops = cpu::vector_ops();
  constexpr int64_t kChunk = 1 << 14;
#pragma omp parallel for schedule(static) if (n > 4 * kChunk)
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t len = std::min(kChunk, n - begin);
    ops.adamw(theta + begin, grad + begin, m + begin, v + begin, len, step);
  }
}

}  // namespace meshtune
