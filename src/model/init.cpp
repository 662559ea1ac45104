#include "model/init.h"

#include <cmath>

#include "core/error.h"
#include "core/random.h"

namespace meshtune {

static WeightMatrix random_matrix(SplitMix64& rng, int64_t rows, int64_t cols, float stddev, DType dtype) {
  WeightMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.dtype = dtype;
  const size_t n = size_t(rows) * size_t(cols);
  if (dtype == DType::F32) {
    auto data = std::shared_ptr<float[]>(new float[n]);
    for (size_t i = 0; i < n; ++i) data[i] = rng.normal() * stddev;
    m.data = data.get();
    m.owner = data;
  } else {
    auto data = std::shared_ptr<uint16_t[]>(new uint16_t[n]);
    for (size_t i = 0; i < n; ++i) data[i] = f32_to_bf16(rng.normal() * stddev);
    m.data = data.get();
    m.owner = data;
  }
  return m;
}

static std::vector<float> random_scale(SplitMix64& rng, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = 0.1f * rng.normal();
  return v;
}

GemmaModel random_model(const GemmaConfig& c, uint64_t seed, DType dtype) {
  check(dtype == DType::F32 || dtype == DType::BF16, "random_model: dtype must be float32 or bfloat16");
  SplitMix64 rng{seed};
  GemmaModel m;
  m.config = c;
  const int64_t D = c.hidden_dim, N = c.num_query_heads, K = c.num_key_value_heads, H = c.head_dim, F = c.ffw_dim;
  m.embeddings = random_matrix(rng, c.vocab_size, D, float(1 / std::sqrt(double(D))), dtype);
  for (int i = 0; i < c.num_layers; ++i) {
    DecoderLayerWeights l;
    l.pre_attention_norm = random_scale(rng, D);
    l.pre_ffw_norm = random_scale(rng, D);
    if (c.use_post_attention_norm) l.post_attention_norm = random_scale(rng, D);
    if (c.use_post_ffw_norm) l.post_ffw_norm = random_scale(rng, D);
    if (c.use_query_key_norm) {
      l.query_norm = random_scale(rng, H);
      l.key_norm = random_scale(rng, H);
    }
    const float in_d = float(1 / std::sqrt(double(D))), in_nh = float(1 / std::sqrt(double(N * H))),
                in_f = float(1 / std::sqrt(double(F)));
    l.query = random_matrix(rng, N * H, D, in_d, dtype);
    l.key = random_matrix(rng, K * H, D, in_d, dtype);
    l.value = random_matrix(rng, K * H, D, in_d, dtype);
    l.attention_output = random_matrix(rng, D, N * H, in_nh, dtype);
    l.ffw_gating = random_matrix(rng, F, D, in_d, dtype);
    l.ffw_gating_2 = random_matrix(rng, F, D, in_d, dtype);
    l.ffw_linear = random_matrix(rng, D, F, in_f, dtype);
    m.layers.push_back(std::move(l));
  }
  m.final_norm = random_scale(rng, D);
  return m;
}

}  // namespace meshtune
