#include "core/random.h"

#include <algorithm>
#include <vector>

#include "core/tensor.h"

namespace meshtune {

// Block `b` of the array: values b·kNormalBlock … into out[0, count). Marsaglia's polar method in
// float, two normals per accepted point: a point (x, y) uniform in the unit disc (24-bit
// coordinates from one 64-bit draw) gives x·f and y·f with f = √(−2 ln s / s), s = x² + y². About
// twice as fast as Box–Muller in double: no sine or cosine, and a 7B model needs 8.5 billion values.
static void normal_block(float* out, size_t count, uint64_t seed, size_t b, float stddev) {
  SplitMix64 rng{derive_seed(seed, b)};
  for (size_t i = 0; i < count; i += 2) {
    float x, y, s;
    do {
      const uint64_t bits = rng.next();
      x = float(int64_t(bits >> 40) - 0x800000) * 0x1.0p-23f;             // [−1, 1)
      y = float(int64_t((bits >> 16) & 0xffffff) - 0x800000) * 0x1.0p-23f;
      s = x * x + y * y;
    } while (s >= 1 || s == 0);
    const float f = std::sqrt(-2 * std::log(s) / s) * stddev;
    out[i] = x * f;
    if (i + 1 < count) out[i + 1] = y * f;
  }
}

static size_t num_blocks(size_t n) { return (n + kNormalBlock - 1) / kNormalBlock; }

void fill_normal(float* out, size_t n, uint64_t seed, float stddev) {
  const size_t blocks = num_blocks(n);
#pragma omp parallel for schedule(static)
  for (size_t b = 0; b < blocks; ++b)
    normal_block(out + b * kNormalBlock, std::min(kNormalBlock, n - b * kNormalBlock), seed, b, stddev);
}

void fill_normal_bf16(uint16_t* out, size_t n, uint64_t seed, float stddev) {
  const size_t blocks = num_blocks(n);
#pragma omp parallel
  {
    std::vector<float> block(kNormalBlock);  // one fp32 block per thread, never the whole array
#pragma omp for schedule(static)
    for (size_t b = 0; b < blocks; ++b) {
      const size_t count = std::min(kNormalBlock, n - b * kNormalBlock);
      normal_block(block.data(), count, seed, b, stddev);
      std::transform(block.begin(), block.begin() + ptrdiff_t(count), out + b * kNormalBlock, f32_to_bf16);
    }
  }
}

}  // namespace meshtune
