// Scalar arithmetic that must round the same way on every backend: bfloat16 conversion (round to
// nearest even), GeGLU's formula, RoPE's inverse frequencies and Keras' int8 codes. Plain inline functions for host code; compiled by
// nvcc they are also device functions, so the CUDA kernels call these very lines.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define MESHTUNE_HOST_DEVICE __host__ __device__
#else
#define MESHTUNE_HOST_DEVICE
#endif

namespace meshtune {

// bfloat16 <-> float32. bf16 is the top half of an fp32; conversion to bf16 rounds to nearest even.
MESHTUNE_HOST_DEVICE inline float bf16_to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
MESHTUNE_HOST_DEVICE inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
// f rounded to the nearest bf16 value (as an fp32): what a bf16 matmul input holds.
MESHTUNE_HOST_DEVICE inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// GeGLU's gelu_tanh(u) = 0.5·u·(1 + tanh a) = u·σ(2a), a = √(2/π)·(u + 0.044715·u³) (Keras'
// gelu(approximate=True)), in fp32 on every backend, each with its own exp: σ(2a) = 1 / (1 + e^x)
// with x = gelu_sigmoid_exponent(u), and d/du gelu_tanh(u) = gelu_slope(u, σ(2a)).
MESHTUNE_HOST_DEVICE inline float gelu_sigmoid_exponent(float u) {
  return -2.f * (0.7978845608028654f * (u + 0.044715f * u * u * u));
}
// s + 2u·s(1 − s)·√(2/π)·(1 + 3·0.044715·u²) with s = σ(2a) (1 + tanh a = 2s, 1 − tanh² a = 4s(1 − s)).
MESHTUNE_HOST_DEVICE inline float gelu_slope(float u, float s) {
  return s + 2.f * u * s * (1.f - s) * 0.7978845608028654f * (1.f + 3.f * 0.044715f * u * u);
}

// RoPE's inverse frequency of pair i of a head of width head_dim: 1 / base^(2i/head_dim), divided
// by the scaling factor — in fp32, as Keras computes it (the angle is then position · this, in fp32).
MESHTUNE_HOST_DEVICE inline float rope_inverse_frequency(int64_t i, int64_t head_dim, float base, float scaling) {
  return float(1.0 / ::pow(double(base), double(2 * i) / double(head_dim))) / scaling;
}

// Keras' int8 (quantize("int8")): the scale of a row whose largest magnitude is `abs_max`,
// 127 / (abs_max + 1e-7) — a float32 add, then a float32 divide —, and the code of v at scale s,
// clip(round half to even(v·s), −127, 127). Clipping first gives the same codes (what rounds
// beyond ±127 clips to ±127 either way), and for |x| ≤ 127 adding and then subtracting 1.5·2²³
// rounds x to an integer, ties to even, in the default rounding mode — as nearbyint does, without a
// libm call per value (a 7B model's 8.5 billion at load).
MESHTUNE_HOST_DEVICE inline float int8_scale(float abs_max) { return 127.0f / (abs_max + 1e-7f); }
MESHTUNE_HOST_DEVICE inline int8_t int8_code(float v, float s) {
  constexpr float kRoundToInteger = 12582912.f;  // 1.5 · 2^23
  const float scaled = v * s;
  const float clipped = scaled < -127.f ? -127.f : 127.f < scaled ? 127.f : scaled;  // std::min(std::max(…))
  return int8_t((clipped + kRoundToInteger) - kRoundToInteger);
}

}  // namespace meshtune
