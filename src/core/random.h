// splitmix64: a tiny, fully specified generator, so the same seed gives the same numbers on every
// platform and standard library (std::*_distribution algorithms are implementation-defined).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace meshtune {

struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  // Box–Muller on (0, 1) uniforms.
  float normal() {
    const double u1 = (double(next() >> 11) + 0.5) * 0x1.0p-53, u2 = (double(next() >> 11) + 0.5) * 0x1.0p-53;
    return float(std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
};

// The seed of stream `index` of `seed` (a variable of a model, a block of an array). The index is
// mixed before it meets the seed, so neighbouring indices and seeds give unrelated streams.
inline uint64_t derive_seed(uint64_t seed, uint64_t index) {
  return SplitMix64{seed ^ SplitMix64{index}.next()}.next();
}

// out[0, n) ~ N(0, stddev²), in parallel (OpenMP) and the same for any number of threads: the array
// is cut into blocks of kNormalBlock values, block b drawn from SplitMix64{derive_seed(seed, b)}.
constexpr size_t kNormalBlock = size_t(1) << 16;
void fill_normal(float* out, size_t n, uint64_t seed, float stddev);
// The same values rounded to bfloat16 (the bits f32_to_bf16 gives), without an fp32 copy of the array.
void fill_normal_bf16(uint16_t* out, size_t n, uint64_t seed, float stddev);

}  // namespace meshtune
