#include "kernels/activation.h"

#include <algorithm>
#include <bit>

namespace meshtune {

// e^x within ~2 ulp for x in [−87, 88] (clamped there: e^−87 ≈ 1.6e−38, e^88 ≈ 1.7e38): x = n·ln 2 + r
// with |r| ≤ ln2/2, e^r by its Taylor series to r⁷/7!, 2ⁿ through the exponent bits. No calls and
// no branches, so the compiler turns loops over it into SIMD code (std::exp stays scalar). This file
// is compiled with -fno-trapping-math (we never enable FP exceptions), without which GCC keeps the
// clamps as branches and the loops scalar.
static inline float exp_for_simd(float x) {
  x = std::max(x, -87.f);  // (not fmin/fmax: their NaN rules block SIMD)
  x = std::min(x, 88.f);
  // n = round(x / ln 2); truncating a positive value is floor, and truncation vectorises.
  const int32_t ni = int32_t(x * 1.44269504088896341f + 256.5f) - 256;
  const float n = float(ni);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // ln 2 in two parts
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const float scale = std::bit_cast<float>((ni + 127) << 23);
  return p * scale;
}

// gelu_tanh(u) = 0.5·u·(1 + tanh a), a = √(2/π)·(u + 0.044715·u³), computed as u·σ(2a) (since
// 1 + tanh a = 2σ(2a)): one exp_for_simd and one division, so loops over it vectorise.
static inline float gelu_tanh(float u) {
  const float a = 0.7978845608028654f * (u + 0.044715f * u * u * u);  // √(2/π)·(u + 0.044715·u³)
  return u / (1.f + exp_for_simd(-2.f * a));
}

void geglu(float* gate, const float* up, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) gate[i] = gelu_tanh(gate[i]) * up[i];
}

void soft_cap(float* x, int64_t n, float cap) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] = std::tanh(x[i] / cap) * cap;
}

// d/du gelu_tanh(u) = 0.5·(1 + tanh a) + 0.5·u·(1 − tanh² a)·√(2/π)·(1 + 3·0.044715·u²),
// with a = √(2/π)·(u + 0.044715·u³); with s = σ(2a): 1 + tanh a = 2s and 1 − tanh² a = 4s(1 − s), so
// d/du = s + 2u·s(1 − s)·√(2/π)·(1 + 3·0.044715·u²).
void geglu_backward(const float* gate, const float* up, const float* dout, int64_t n, float* dgate, float* dup) {
  const float k = 0.7978845608028654f;  // √(2/π), as in gelu_tanh
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    // Read everything first so the outputs may alias the inputs.
    const float u = gate[i], g = dout[i], w = up[i];
    const float s = 1.f / (1.f + exp_for_simd(-2.f * k * (u + 0.044715f * u * u * u)));
    const float gelu = u * s;
    const float dgelu = s + 2.f * u * s * (1.f - s) * k * (1.f + 3.f * 0.044715f * u * u);
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
