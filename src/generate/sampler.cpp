#include "generate/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace meshtune {

Sampler::Sampler(const SamplerOptions& o) : options_(o) {
  check(o.name == "greedy" || o.name == "top_k" || o.name == "top_p" || o.name == "random",
        "unknown sampler '", o.name, "' (expected greedy, top_k, top_p or random)");
  check(o.temperature > 0 && std::isfinite(o.temperature), "--temperature must be finite and positive, got ",
        o.temperature);
  check(o.top_k >= 1, "--top-k must be at least 1, got ", o.top_k);
  check(o.top_p > 0 && o.top_p <= 1, "--top-p must be in (0, 1], got ", o.top_p);
  rng_.seed(o.seeded ? o.seed : std::random_device{}());
}

double Sampler::uniform() { return double(rng_() >> 11) * 0x1.0p-53; }

int Sampler::sample(const float* logits, int V) {
  if (options_.name == "greedy") return int(std::max_element(logits, logits + V) - logits);  // ties: first
  // Probabilities in fp32, as KerasHub computes them.
  std::vector<float> probs(logits, logits + V);
  const float max_logit = *std::max_element(probs.begin(), probs.end());
  float sum = 0;
  for (float& p : probs) sum += (p = std::exp((p - max_logit) / options_.temperature));
  for (float& p : probs) p /= sum;

  // Candidates in descending probability (only as many as the sampler can keep).
  std::vector<int> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  size_t keep = size_t(V);
  if (options_.name == "top_k") keep = std::min(size_t(options_.top_k), size_t(V));
  if (options_.name != "random") {
    auto by_prob = [&](int a, int b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); };
    if (keep < size_t(V)) std::partial_sort(order.begin(), order.begin() + keep, order.end(), by_prob);
    else std::sort(order.begin(), order.end(), by_prob);
  }
  if (options_.name == "top_p") {  // keep i while the cumulative probability before i is ≤ p
    double cumulative = 0;
    size_t n = 0;
    while (n < order.size() && (n == 0 || cumulative <= options_.top_p)) cumulative += probs[order[n++]];
    keep = n;
  }
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += probs[order[i]];
  double r = uniform() * total;
  for (size_t i = 0; i < keep; ++i) {
    r -= probs[order[i]];
    if (r < 0) return order[i];
  }
  return order[keep - 1];
}

}  // namespace meshtune
