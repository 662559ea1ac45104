// splitmix64: a tiny, fully specified generator, so the same seed gives the same numbers on every
// platform and standard library (std::*_distribution algorithms are implementation-defined).
#pragma once
#include <cmath>
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

}  // namespace meshtune
