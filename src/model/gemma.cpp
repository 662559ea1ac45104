#include "model/gemma.h"

#include <cmath>

#include "core/error.h"
#include "kernels/activation.h"
#include "kernels/attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"

namespace meshtune {

size_t GemmaModel::weight_bytes() const {
  size_t total = embeddings.nbytes() + final_norm.size() * 4;
  for (const auto& l : layers) {
    for (const auto* m : {&l.query, &l.key, &l.value, &l.attention_output, &l.ffw_gating, &l.ffw_gating_2,
                          &l.ffw_linear})
      total += m->nbytes();
    for (const auto* v : {&l.pre_attention_norm, &l.post_attention_norm, &l.pre_ffw_norm, &l.post_ffw_norm,
                          &l.query_norm, &l.key_norm})
      total += v->size() * 4;
  }
  return total;
}

KVCache::KVCache(const GemmaConfig& c, int64_t b, int64_t s) : batch(b), capacity(s) {
  const size_t per_layer = size_t(b) * size_t(s) * size_t(c.num_key_value_heads) * size_t(c.head_dim);
  keys.assign(size_t(c.num_layers), std::vector<float>(per_layer));
  values.assign(size_t(c.num_layers), std::vector<float>(per_layer));
  key_valid.assign(size_t(b) * size_t(s), 1);
}

// One decoder block, in place on the residual stream x [M = B·T, D].
static void decoder_block(const GemmaConfig& c, const DecoderLayerWeights& w, int layer, float* x, int64_t B,
                          int64_t T, int64_t start, KVCache& cache) {
  const int64_t M = B * T, D = c.hidden_dim, N = c.num_query_heads, K = c.num_key_value_heads, H = c.head_dim,
                F = c.ffw_dim, S = cache.capacity;
  const float eps = c.layer_norm_epsilon;
  std::vector<float> normed(size_t(M * D)), q(size_t(M * N * H)), k(size_t(M * K * H)), v(size_t(M * K * H));

  // --- attention ---
  rmsnorm(x, w.pre_attention_norm.data(), M, D, eps, normed.data());
  linear(normed.data(), M, w.query, q.data());
  linear(normed.data(), M, w.key, k.data());
  linear(normed.data(), M, w.value, v.data());
  if (c.use_query_key_norm) {  // Gemma 3: per-head RMSNorm before RoPE
    rmsnorm(q.data(), w.query_norm.data(), M * N, H, eps, q.data());
    rmsnorm(k.data(), w.key_norm.data(), M * K, H, eps, k.data());
  }
  std::vector<int64_t> positions(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) positions[m] = start + m % T;
  rope(q.data(), M, N, H, positions.data(), c.rope_base(layer), c.rope_scaling(layer));
  rope(k.data(), M, K, H, positions.data(), c.rope_base(layer), c.rope_scaling(layer));
  const float scale = c.query_scale();
  for (float& value : q) value *= scale;

  // Write this step's keys/values into the cache at [b, start + t].
  float* cache_k = cache.keys[layer].data();
  float* cache_v = cache.values[layer].data();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const size_t src = size_t((b * T + t) * K * H), dst = size_t((b * S + start + t) * K * H);
      std::copy(k.begin() + src, k.begin() + src + K * H, cache_k + dst);
      std::copy(v.begin() + src, v.begin() + src + K * H, cache_v + dst);
    }

  AttentionShape shape;
  shape.batch = B;
  shape.query_len = T;
  shape.start = start;
  shape.capacity = S;
  shape.heads = N;
  shape.kv_heads = K;
  shape.head_dim = H;
  shape.window = c.is_sliding(layer) ? c.sliding_window_size : 0;
  shape.soft_cap = c.attention_logit_soft_cap;
  std::vector<float> attended(size_t(M * N * H)), projected(size_t(M * D));
  attention(q.data(), cache_k, cache_v, cache.key_valid.data(), shape, attended.data());
  linear(attended.data(), M, w.attention_output, projected.data());
  if (c.use_post_attention_norm) rmsnorm(projected.data(), w.post_attention_norm.data(), M, D, eps, projected.data());
  for (int64_t i = 0; i < M * D; ++i) x[i] += projected[i];

  // --- feed-forward (GeGLU) ---
  rmsnorm(x, w.pre_ffw_norm.data(), M, D, eps, normed.data());
  std::vector<float> gate(size_t(M * F)), up(size_t(M * F));
  linear(normed.data(), M, w.ffw_gating, gate.data());
  linear(normed.data(), M, w.ffw_gating_2, up.data());
  geglu(gate.data(), up.data(), M * F);
  linear(gate.data(), M, w.ffw_linear, projected.data());
  if (c.use_post_ffw_norm) rmsnorm(projected.data(), w.post_ffw_norm.data(), M, D, eps, projected.data());
  for (int64_t i = 0; i < M * D; ++i) x[i] += projected[i];
}

std::vector<float> backbone_forward(const GemmaModel& model, const int32_t* tokens, int64_t B, int64_t T,
                                    int64_t start, KVCache& cache, ForwardTrace* trace) {
  const GemmaConfig& c = model.config;
  const int64_t D = c.hidden_dim, M = B * T;
  check(B <= cache.batch && start + T <= cache.capacity, "KV cache too small: ", B, " rows × ", start + T,
        " positions needed, ", cache.batch, " × ", cache.capacity, " allocated");
  std::vector<float> x(size_t(M * D));
  for (int64_t m = 0; m < M; ++m) {
    const int32_t id = tokens[m];
    check(id >= 0 && id < c.vocab_size, "token id ", id, " at [", m / T, ", ", m % T,
          "] is outside the vocabulary (size ", c.vocab_size, ")");
    model.embeddings.row_to_f32(id, x.data() + m * D);
  }
  if (trace) trace->embedding_lookup = x;
  const float embedding_scale = float(std::sqrt(double(D)));  // rounded to the compute dtype first
  for (float& value : x) value *= embedding_scale;
  if (trace) trace->embedding_scaled = x;

  for (int layer = 0; layer < c.num_layers; ++layer) {
    decoder_block(c, model.layers[size_t(layer)], layer, x.data(), B, T, start, cache);
    if (trace) trace->block_outputs.push_back(x);
  }
  rmsnorm(x.data(), model.final_norm.data(), M, D, c.layer_norm_epsilon, x.data());
  return x;
}

void lm_head(const GemmaModel& model, const float* hidden, int64_t M, float* logits) {
  linear(hidden, M, model.embeddings, logits);
  if (model.config.final_logit_soft_cap > 0)
    soft_cap(logits, M * model.config.vocab_size, model.config.final_logit_soft_cap);
}

}  // namespace meshtune
