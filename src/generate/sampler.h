// Samplers with KerasHub's semantics (spec §6): greedy (Gemma's default), top_k (k=5),
// top_p (p=0.1: keep the tokens whose preceding cumulative probability is ≤ p), random (full
// softmax); probabilities = softmax(logits / temperature) in fp32. Seeded runs repeat exactly.
#pragma once
#include <cstdint>
#include <random>
#include <string>

namespace meshtune {

struct SamplerOptions {
  std::string name = "greedy";  // greedy | top_k | top_p | random
  int top_k = 5;
  float top_p = 0.1f;
  float temperature = 1.0f;
  bool seeded = false;
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplerOptions& options);  // throws Error for an unknown name or bad value
  int sample(const float* logits, int vocab_size);

 private:
  double uniform();  // [0, 1)
  SamplerOptions options_;
  std::mt19937_64 rng_;
};

}  // namespace meshtune
