#include "backend/cpu/activation.h"

#include <algorithm>


namespace meshtune {

void geglu(const KernelPath& path, const float* gate, const float* up, int64_t n, float* out) {
  const cpu::VectorOps& ops = path.ops();
#pragma omp parallel for schedule(static) if (n > 4 * cpu::kElementsPerCall)
  for (int64_t begin = 0; begin < n; begin += cpu::kElementsPerCall)
    ops.geglu(gate + begin, up + begin, std::min(cpu::kElementsPerCall, n - begin), out + begin);
}

void soft_cap(float* x, int64_t n, float cap) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] = std::tanh(x[i] / cap) * cap;
}

void geglu_backward(const KernelPath& path, const float* gate, const float* up, const float* dout, int64_t n, float* dgate, float* dup) {
  const cpu::VectorOps& ops = path.ops();
#pragma omp parallel for schedule(static) if (n > 4 * cpu::kElementsPerCall)
  for (int64_t begin = 0; begin < n; begin += cpu::kElementsPerCall)
    ops.geglu_backward(gate + begin, up + begin, dout + begin, std::min(cpu::kElementsPerCall, n - begin), dgate + begin,
                       dup + begin);
}

// tanh' = 1 − tanh², and tanh(x/cap) = y/cap, so the output alone gives the derivative.
void soft_cap_backward(const float* y, float* dy, int64_t n, float cap) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float t = y[i] / cap;
    dy[i] *= 1.f - t * t;
  }
}

}  // namespace meshtune
