// The bodies of backend/cpu/isa/vector_ops.h, compiled once per instruction set: each including file
// defines MESHTUNE_VECTOR_OPS (the name of its accessor) and is compiled with its own -m flags.
// Plain loops that the compiler vectorises for that set. The files are compiled with
// -ffp-contract=off: a multiply-add is fused only where MULADD says so (and only where the set has
// FMA), so that AdamW and RoPE round exactly as Keras does on every path; -fno-trapping-math and
// -fno-math-errno let the clamps and square roots vectorise. Everything here has internal linkage
// and uses no standard-library code (backend/cpu/isa/gemv.h says why).
#include <cstdint>

#include "backend/cpu/isa/vector_ops.h"
#include "core/scalar_math.h"

#ifndef MESHTUNE_VECTOR_OPS
#error "define MESHTUNE_VECTOR_OPS before including vector_ops_body.h"
#endif

#if defined(__FMA__)
#define MULADD(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define MULADD(a, b, c) ((a) * (b) + (c))
#endif

namespace meshtune::cpu {
namespace {

// Reductions keep this many partial sums: enough independent chains to hide the add latency, and
// the same summation order on every path.
constexpr int kLanes = 32;

template <class Sum>  // float or double partial sums
Sum sum_lanes(Sum* acc) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  return acc[0];
}

float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = MULADD(a[i + l], b[i + l], acc[l]);
  for (int l = 0; i < n; ++i, ++l) acc[l] = MULADD(a[i], b[i], acc[l]);
  return sum_lanes(acc);
}

void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = MULADD(alpha, x[i], y[i]);
}

// e^x within ~2 ulp for x in [−87, 88], 0 below −87 (e^−87 ≈ 1.6e−38), e^88 above 88, NaN for NaN:
// x = k·ln 2 + r with |r| ≤ ln2/2, e^r by its Taylor series to r⁷/7!, 2ᵏ through the exponent bits.
// No calls and no branches, so loops over it vectorise (std::exp stays scalar).
inline float exp_approx(float x) {
  const float c = x > -87.f ? (x < 88.f ? x : 88.f) : -87.f;  // NaN → −87: the conversion below stays defined
  // k = round(c / ln 2); truncating a positive value is floor, and truncation vectorises.
  const int32_t k = int32_t(c * 1.44269504088896341f + 256.5f) - 256;
  const float kf = float(k);
  const float r = (c - kf * 0.693145751953125f) - kf * 1.428606765330187e-06f;  // ln 2 in two parts
  float p = 1.f / 5040.f;
  p = MULADD(p, r, 1.f / 720.f);
  p = MULADD(p, r, 1.f / 120.f);
  p = MULADD(p, r, 1.f / 24.f);
  p = MULADD(p, r, 1.f / 6.f);
  p = MULADD(p, r, 0.5f);
  p = MULADD(p, r, 1.f);
  p = MULADD(p, r, 1.f);
  const float e = p * __builtin_bit_cast(float, (k + 127) << 23);
  return x != x ? x : (x < -87.f ? 0.f : e);  // NaN stays NaN
}

// σ(2a) of gelu_tanh(u) = u·σ(2a) (core/scalar_math.h, shared with the GPU's kernels).
inline float gelu_sigmoid(float u) { return 1.f / (1.f + exp_approx(gelu_sigmoid_exponent(u))); }

void geglu(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] * gelu_sigmoid(gate[i]) * up[i];
}

void geglu_backward(const float* gate, const float* up, const float* dout, int64_t n, float* dgate, float* dup) {
  for (int64_t i = 0; i < n; ++i) {
    const float u = gate[i], g = dout[i], w = up[i];  // read first: the outputs may alias the inputs
    const float s = gelu_sigmoid(u);
    dgate[i] = g * w * gelu_slope(u, s);
    dup[i] = g * (u * s);
  }
}

float rms_inverse(const float* x, int64_t n, float eps) {
  return 1.f / __builtin_sqrtf(dot(x, x, n) / float(n) + eps);
}

void rmsnorm_row(const float* x, const float* scale, int64_t n, float eps, float* y) {
  const float inv = rms_inverse(x, n, eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * inv) * (1.f + scale[i]);
}

// With r = rsqrt(mean(x²) + eps) and w = 1 + scale:
//   dx_i = r·w_i·dy_i − r³/n · x_i · Σ_j dy_j·w_j·x_j,   dscale_i += dy_i·x_i·r.
// dx may alias dy, so all of dy is read (the sum, dscale) before dx is written.
void rmsnorm_backward_row(const float* x, const float* scale, int64_t n, float eps, const float* dy, float* dx,
                          float* dscale) {
  const float inv = rms_inverse(x, n, eps);
  float acc[kLanes] = {};  // Σ dy·w·x
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = MULADD(dy[i + l] * (1.f + scale[i + l]), x[i + l], acc[l]);
  for (int l = 0; i < n; ++i, ++l) acc[l] = MULADD(dy[i] * (1.f + scale[i]), x[i], acc[l]);
  const float coef = inv * inv * inv * sum_lanes(acc) / float(n);
  if (dscale)
    for (int64_t j = 0; j < n; ++j) dscale[j] = MULADD(dy[j] * x[j], inv, dscale[j]);
  for (int64_t j = 0; j < n; ++j) dx[j] = inv * (1.f + scale[j]) * dy[j] - coef * x[j];
}

void rotate_halves(float* v, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * cos[i] - x2 * sin[i];
    v[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

float exp_shifted(float* x, int64_t n, float shift) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      x[i + l] = exp_approx(x[i + l] - shift);
      acc[l] += x[i + l];
    }
  for (int l = 0; i < n; ++i, ++l) {
    x[i] = exp_approx(x[i] - shift);
    acc[l] += x[i];
  }
  return sum_lanes(acc);
}

double sum_exp_shifted(const float* x, int64_t n, float shift) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += double(exp_approx(x[i + l] - shift));
  for (int l = 0; i < n; ++i, ++l) acc[l] += double(exp_approx(x[i] - shift));
  return sum_lanes(acc);
}

void softmax_gradient(float* z, int64_t n, float shift, float scale, float cap) {
  if (cap > 0) {
    for (int64_t i = 0; i < n; ++i) {
      const float t = z[i] / cap;
      z[i] = exp_approx(z[i] - shift) * scale * (1.f - t * t);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) z[i] = exp_approx(z[i] - shift) * scale;
  }
}

void narrow_bf16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = __builtin_bit_cast(uint32_t, src[i]);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    dst[i] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);  // NaN stays NaN
  }
}

void adamw(float* theta, const float* g, float* m, float* v, int64_t n, const AdamWStep& s) {
  if (s.decay)
    for (int64_t i = 0; i < n; ++i) theta[i] = theta[i] - (theta[i] * s.weight_decay) * s.learning_rate;
  for (int64_t i = 0; i < n; ++i) {
    m[i] = m[i] + (g[i] - m[i]) * s.one_minus_beta_1;
    v[i] = v[i] + (g[i] * g[i] - v[i]) * s.one_minus_beta_2;
    theta[i] = theta[i] - (m[i] * s.alpha) / (__builtin_sqrtf(v[i]) + s.epsilon);
  }
}

const VectorOps kOps = {
    .dot = dot,
    .axpy = axpy,
    .rmsnorm_row = rmsnorm_row,
    .rmsnorm_backward_row = rmsnorm_backward_row,
    .geglu = geglu,
    .geglu_backward = geglu_backward,
    .rotate_halves = rotate_halves,
    .exp = exp_approx,
    .exp_shifted = exp_shifted,
    .sum_exp_shifted = sum_exp_shifted,
    .softmax_gradient = softmax_gradient,
    .narrow_bf16 = narrow_bf16,
    .adamw = adamw,
};

}  // namespace

const VectorOps& MESHTUNE_VECTOR_OPS() { return kOps; }

}  // namespace meshtune::cpu

#undef MULADD
