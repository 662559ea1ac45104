#include "backend/cpu/rope.h"

#include <cmath>
#include <vector>

#include "core/scalar_math.h"


namespace meshtune {

namespace {

// Rotates each half-pair by +θ (forward) or −θ (inverse). Both directions share this one angle
// computation, so the backward is exactly the transpose of the forward's rotation.
void rotate(const KernelPath& path, float* x, int64_t tokens, int64_t heads, int64_t head_dim, const int64_t* positions, float base,
            float scaling, bool inverse) {
  const cpu::VectorOps& ops = path.ops();
  const int64_t half = head_dim / 2;
  // Keras computes the inverse frequencies and angles in fp32.
  std::vector<float> inv_freq(half);
  for (int64_t i = 0; i < half; ++i)
    inv_freq[i] = rope_inverse_frequency(i, head_dim, base, scaling);
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim > 65536)
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<float> cos_t(half), sin_t(half);
    for (int64_t i = 0; i < half; ++i) {
      float angle = float(positions[t]) * inv_freq[i];
      cos_t[i] = std::cos(angle);
      sin_t[i] = inverse ? -std::sin(angle) : std::sin(angle);  // sin(−θ) = −sin θ, exactly
    }
    for (int64_t h = 0; h < heads; ++h) ops.rotate_halves(x + (t * heads + h) * head_dim, cos_t.data(), sin_t.data(), half);
  }
}

}  // namespace

void rope(const KernelPath& path, float* x, int64_t tokens, int64_t heads, int64_t head_dim, const int64_t* positions, float base,
          float scaling) {
  rotate(path, x, tokens, heads, head_dim, positions, base, scaling, /*inverse=*/false);
}

void rope_backward(const KernelPath& path, float* dx, int64_t tokens, int64_t heads, int64_t head_dim, const int64_t* positions, float base,
                   float scaling) {
  rotate(path, dx, tokens, heads, head_dim, positions, base, scaling, /*inverse=*/true);
}

}  // namespace meshtune
