#include "backend/cpu/adamw.h"

#include <algorithm>

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

}  // namespace meshtune
