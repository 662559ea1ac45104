#include "kernels/activation.h"

namespace meshtune {

void geglu(float* gate, const float* up, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) gate[i] = gelu_tanh(gate[i]) * up[i];
}

void soft_cap(float* x, int64_t n, float cap) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] = std::tanh(x[i] / cap) * cap;
}

// d/du gelu_tanh(u) = 0.5·(1 + tanh a) + 0.5·u·(1 − tanh² a)·√(2/π)·(1 + 3·0.044715·u²),
// with a = √(2/π)·(u + 0.044715·u³).
void geglu_backward(const float* gate, const float* up, const float* dout, int64_t n, float* dgate, float* dup) {
  const float k = 0.7978845608028654f;  // √(2/π), as in gelu_tanh
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    // Read everything first so the outputs may alias the inputs.
    const float u = gate[i], g = dout[i], w = up[i];
    const float th = std::tanh(k * (u + 0.044715f * u * u * u));
    const float gelu = 0.5f * u * (1.f + th);
    const float dgelu = 0.5f * (1.f + th) + 0.5f * u * (1.f - th * th) * k * (1.f + 3.f * 0.044715f * u * u);
    dgate[i] = g * w * dgelu;
    dup[i] = g * gelu;
  }
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
