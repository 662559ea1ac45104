#include "model/gemma.h"

#include <array>
#include <cmath>

#include "core/error.h"
#include "kernels/activation.h"
#include "kernels/attention.h"
#include "kernels/int8.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/tensor_ops.h"

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

bool GemmaModel::has_int8() const {
  if (embeddings.dtype == DType::I8) return true;
  for (const auto& l : layers)
    for (const auto* m : {&l.query, &l.key, &l.value, &l.attention_output, &l.ffw_gating, &l.ffw_gating_2,
                          &l.ffw_linear})
      if (m->dtype == DType::I8) return true;
  return false;
}

WeightMatrix* DecoderLayerWeights::matrix(Slot slot) {
  switch (slot) {
    case Slot::Query: return &query;
    case Slot::Key: return &key;
    case Slot::Value: return &value;
    case Slot::AttentionOutput: return &attention_output;
    case Slot::FfwGating: return &ffw_gating;
    case Slot::FfwGating2: return &ffw_gating_2;
    case Slot::FfwLinear: return &ffw_linear;
    default: return nullptr;
  }
}

std::vector<float>* DecoderLayerWeights::vector(Slot slot) {
  switch (slot) {
    case Slot::PreAttentionNorm: return &pre_attention_norm;
    case Slot::PostAttentionNorm: return &post_attention_norm;
    case Slot::PreFfwNorm: return &pre_ffw_norm;
    case Slot::PostFfwNorm: return &post_ffw_norm;
    case Slot::QueryNorm: return &query_norm;
    case Slot::KeyNorm: return &key_norm;
    default: return nullptr;
  }
}

const LowRankTerm& GemmaModel::low_rank_term(int layer, Slot slot) const {
  static const LowRankTerm none;
  if (low_rank.empty()) return none;
  return *const_cast<LayerLowRank&>(low_rank[size_t(layer)]).of(slot);
}

// Under tensor parallelism attention_output and ffw_linear see only this process' slice of their
// input (its heads, its FFN columns). int8 quantizes each token by its largest magnitude over the
// whole input (as Keras does, and as JAX computes it on a sharded array), so the slices' maxima are
// combined first; the partial products then add up as the float ones do.
static bool input_is_split(const GemmaModel& model, Slot slot) {
  return model.tensor_parallel && (slot == Slot::AttentionOutput || slot == Slot::FfwLinear);
}

void project(const GemmaModel& model, int layer, Slot slot, const float* x, int64_t M, const WeightMatrix& W, float* y) {
  if (W.dtype == DType::I8 && input_is_split(model, slot)) {
    FloatBuffer token_max(static_cast<size_t>(M));
    row_abs_max(x, M, W.cols, token_max.data());
    model.tensor_parallel->all_reduce_max(token_max.data(), token_max.size());
    linear_int8(x, M, W, y, token_max.data());
  } else {
    linear(x, M, W, y, model.matmul_precision);
  }
  const LowRankTerm& lora = model.low_rank_term(layer, slot);
  if (!lora.active()) return;
  check(lora.in == W.cols && lora.out() == W.rows, "LoRA term of decoder_block_", layer, "/", int(slot), " is ",
        lora.out(), "×", lora.in, " but its matrix is ", W.rows, "×", W.cols);
  low_rank_forward(x, M, lora, y);
}

WeightMatrix* GemmaModel::matrix(Slot slot, int layer) {
  if (slot == Slot::Embeddings) return &embeddings;
  return layer >= 0 ? layers[size_t(layer)].matrix(slot) : nullptr;
}

std::vector<float>* GemmaModel::vector(Slot slot, int layer) {
  if (slot == Slot::FinalNorm) return &final_norm;
  return layer >= 0 ? layers[size_t(layer)].vector(slot) : nullptr;
}

KVCache::KVCache(const GemmaConfig& c, int64_t b, int64_t s) : batch(b), capacity(s) {
  const size_t per_layer = size_t(b) * size_t(s) * size_t(c.num_key_value_heads) * size_t(c.head_dim);
  for (int layer = 0; layer < c.num_layers; ++layer) {
    keys.emplace_back(per_layer);
    values.emplace_back(per_layer);
  }
  key_valid.assign(size_t(b) * size_t(s), 1);
}

AttentionShape attention_shape(const GemmaConfig& c, int layer, int64_t B, int64_t T, int64_t start, int64_t S) {
  AttentionShape shape;
  shape.batch = B;
  shape.query_len = T;
  shape.start = start;
  shape.capacity = S;
  shape.heads = c.num_query_heads;
  shape.kv_heads = c.num_key_value_heads;
  shape.head_dim = c.head_dim;
  shape.window = c.is_sliding(layer) ? c.sliding_window_size : 0;
  shape.soft_cap = c.attention_logit_soft_cap;
  return shape;
}

// One decoder block, in place on the residual stream x [M = B·T, D]; `a` receives the block's
// intermediate values (the caller keeps them for backward, or drops them).
static void decoder_block(const GemmaModel& model, const DecoderLayerWeights& w, int layer, float* x, int64_t B,
                          int64_t T, int64_t start, KVCache& cache, BlockActivations& a, BlockScratch& s) {
  const GemmaConfig& c = model.config;
  const int64_t M = B * T, D = c.hidden_dim, N = c.num_query_heads, K = c.num_key_value_heads, H = c.head_dim,
                F = c.ffw_dim, S = cache.capacity;
  const float eps = c.layer_norm_epsilon;
  // Every buffer is overwritten by its producer, so a reused one keeps its memory and is not cleared.
  auto buffer = [](FloatBuffer& v, int64_t n) { v.resize(static_cast<size_t>(n)); };
  auto copy = [](const float* src, int64_t n, FloatBuffer& dst) {
    dst.resize(static_cast<size_t>(n));
    copy_values(src, n, dst.data());
  };
  copy(x, M * D, a.input);

  // --- attention ---
  buffer(a.attn_normed, M * D);
  buffer(a.q, M * N * H);
  buffer(a.k, M * K * H);
  buffer(a.v, M * K * H);
  rmsnorm(x, w.pre_attention_norm.data(), M, D, eps, a.attn_normed.data());
  project(model, layer, Slot::Query, a.attn_normed.data(), M, w.query, a.q.data());
  project(model, layer, Slot::Key, a.attn_normed.data(), M, w.key, a.k.data());
  project(model, layer, Slot::Value, a.attn_normed.data(), M, w.value, a.v.data());
  if (c.use_query_key_norm) {  // Gemma 3: per-head RMSNorm before RoPE
    copy(a.q.data(), M * N * H, a.q_raw);
    copy(a.k.data(), M * K * H, a.k_raw);
    rmsnorm(a.q_raw.data(), w.query_norm.data(), M * N, H, eps, a.q.data());
    rmsnorm(a.k_raw.data(), w.key_norm.data(), M * K, H, eps, a.k.data());
  }
  const std::vector<int64_t> positions = token_positions(B, T, start);
  rope(a.q.data(), M, N, H, positions.data(), c.rope_base(layer), c.rope_scaling(layer));
  rope(a.k.data(), M, K, H, positions.data(), c.rope_base(layer), c.rope_scaling(layer));
  const float scale = c.query_scale();
  scale_in_place(a.q.data(), M * N * H, scale);

  // This step's keys/values go into the cache at [b, start + t].
  float* cache_k = cache.keys[layer].data();
  float* cache_v = cache.values[layer].data();
  write_cache_rows(a.k.data(), B, T, K * H, S, start, cache_k);
  write_cache_rows(a.v.data(), B, T, K * H, S, start, cache_v);

  buffer(a.attended, M * N * H);
  buffer(a.attn_projected, M * D);
  attention(a.q.data(), cache_k, cache_v, cache.key_valid.data(), attention_shape(c, layer, B, T, start, S),
            a.attended.data());
  project(model, layer, Slot::AttentionOutput, a.attended.data(), M, w.attention_output, a.attn_projected.data());
  if (model.tensor_parallel) model.tensor_parallel->all_reduce_sum(a.attn_projected.data(), size_t(M * D));  // Σ over heads
  FloatBuffer& residual = s.residual;
  copy(a.attn_projected.data(), M * D, residual);
  if (c.use_post_attention_norm) rmsnorm(residual.data(), w.post_attention_norm.data(), M, D, eps, residual.data());
  add_into(x, residual.data(), M * D);
  copy(x, M * D, a.mid);

  // --- feed-forward (GeGLU) ---
  buffer(a.ffw_normed, M * D);
  buffer(a.gate, M * F);
  buffer(a.up, M * F);
  buffer(a.ffw_projected, M * D);
  rmsnorm(x, w.pre_ffw_norm.data(), M, D, eps, a.ffw_normed.data());
  project(model, layer, Slot::FfwGating, a.ffw_normed.data(), M, w.ffw_gating, a.gate.data());
  project(model, layer, Slot::FfwGating2, a.ffw_normed.data(), M, w.ffw_gating_2, a.up.data());
  copy(a.gate.data(), M * F, s.activated);
  geglu(s.activated.data(), a.up.data(), M * F);
  project(model, layer, Slot::FfwLinear, s.activated.data(), M, w.ffw_linear, a.ffw_projected.data());
  if (model.tensor_parallel) model.tensor_parallel->all_reduce_sum(a.ffw_projected.data(), size_t(M * D));  // Σ over width
  copy(a.ffw_projected.data(), M * D, residual);
  if (c.use_post_ffw_norm) rmsnorm(residual.data(), w.post_ffw_norm.data(), M, D, eps, residual.data());
  add_into(x, residual.data(), M * D);
}

// The buffers of a block's activations (const or not), in a fixed order (for SavedBlocks' bf16 copies).
template <class Activations>
static auto activation_buffers(Activations& a) {
  const std::array buffers{&a.input, &a.attn_normed, &a.q_raw, &a.k_raw, &a.q, &a.k, &a.v, &a.attended,
                           &a.attn_projected, &a.mid, &a.ffw_normed, &a.gate, &a.up, &a.ffw_projected};
  static_assert(buffers.size() == SavedBlocks::kBuffers);
  return buffers;
}

void SavedBlocks::start(int layers, bool bf16) {
  bf16_ = bf16;
  fp32_.resize(bf16 ? 1 : size_t(layers));
  packed_.resize(bf16 ? size_t(layers) : 0);
  sizes_.resize(bf16 ? size_t(layers) : 0);
}

size_t SavedBlocks::bytes() const {
  size_t total = 0;
  for (const BlockActivations& set : fp32_)
    for (const FloatBuffer* b : activation_buffers(set)) total += b->size() * sizeof(float);
  for (const Bf16Buffer& packed : packed_) total += packed.size() * sizeof(uint16_t);
  return total;
}

BlockActivations& SavedBlocks::forward_set(int layer) { return fp32_[bf16_ ? 0 : size_t(layer)]; }

void SavedBlocks::keep(int layer) {
  if (!bf16_) return;
  const auto buffers = activation_buffers(fp32_[0]);
  size_t total = 0;
  for (size_t i = 0; i < kBuffers; ++i) total += sizes_[size_t(layer)][i] = buffers[i]->size();
  Bf16Buffer& packed = packed_[size_t(layer)];
  packed.resize(total);
  uint16_t* out = packed.data();
  for (const FloatBuffer* b : buffers) {
    narrow_to_bf16(b->data(), int64_t(b->size()), out);
    out += b->size();
  }
}

const BlockActivations& SavedBlocks::backward_set(int layer) {
  BlockActivations& a = fp32_[bf16_ ? 0 : size_t(layer)];
  if (!bf16_) return a;
  const auto buffers = activation_buffers(a);
  const uint16_t* in = packed_[size_t(layer)].data();
  for (size_t i = 0; i < kBuffers; ++i) {
    const size_t n = sizes_[size_t(layer)][i];
    buffers[i]->resize(n);
    widen_bf16_parallel(in, int64_t(n), buffers[i]->data());
    in += n;
  }
  return a;
}

std::vector<float> backbone_forward(const GemmaModel& model, const int32_t* tokens, int64_t B, int64_t T,
                                    int64_t start, KVCache& cache, ForwardTrace* trace,
                                    SavedBlocks* saved, FloatBuffer* final_norm_input) {
  const GemmaConfig& c = model.config;
  const int64_t D = c.hidden_dim, M = B * T;
  check(B <= cache.batch && start + T <= cache.capacity, "KV cache too small: ", B, " rows × ", start + T,
        " positions needed, ", cache.batch, " × ", cache.capacity, " allocated");
  if (const int64_t m = first_id_outside(tokens, M, c.vocab_size); m >= 0)
    fail("token id ", tokens[m], " at [", m / T, ", ", m % T, "] is outside the vocabulary (size ", c.vocab_size, ")");
  FloatBuffer x(size_t(M * D));  // the residual stream
  auto copy_out = [&x, M, D](std::vector<float>& host) { host.assign(x.data(), x.data() + M * D); };
  embedding_lookup(model.embeddings, model.vocab_offset, tokens, M, x.data());
  // Vocabulary split: each row came from one process, the others hold zeros there.
  if (model.vocab_parallel()) model.tensor_parallel->all_reduce_sum(x.data(), x.size());
  if (trace) copy_out(trace->embedding_lookup);
  const float embedding_scale = float(std::sqrt(double(D)));  // rounded to the compute dtype first
  scale_in_place(x.data(), M * D, embedding_scale);
  if (trace) copy_out(trace->embedding_scaled);

  BlockActivations unsaved;
  BlockScratch scratch;
  for (int layer = 0; layer < c.num_layers; ++layer) {
    BlockActivations& a = saved ? saved->forward_set(layer) : unsaved;
    decoder_block(model, model.layer_weights(layer), layer, x.data(), B, T, start, cache, a, scratch);
    if (saved) saved->keep(layer);
    if (trace) copy_out(trace->block_outputs.emplace_back());
  }
  if (final_norm_input) {
    final_norm_input->resize(size_t(M * D));
    copy_values(x.data(), M * D, final_norm_input->data());
  }
  std::vector<float> hidden(static_cast<size_t>(M * D));  // the caller's, on the host
  rmsnorm(x.data(), model.final_norm.data(), M, D, c.layer_norm_epsilon, hidden.data());
  return hidden;
}

void lm_head_local(const GemmaModel& model, const float* hidden, int64_t M, float* logits) {
  linear(hidden, M, model.embeddings, logits, model.matmul_precision);
  if (model.config.final_logit_soft_cap > 0)
    soft_cap(logits, M * model.embeddings.rows, model.config.final_logit_soft_cap);
}

void lm_head(const GemmaModel& model, const float* hidden, int64_t M, float* logits) {
  if (!model.vocab_parallel()) return lm_head_local(model, hidden, M, logits);
  // Each process' columns, gathered (in process = vocabulary order) and laid out row by row.
  const int64_t part = model.embeddings.rows;
  Communicator& comm = *model.tensor_parallel;
  FloatBuffer mine(static_cast<size_t>(M * part)), all(static_cast<size_t>(M * part) * size_t(comm.size()));
  lm_head_local(model, hidden, M, mine.data());
  comm.all_gather(mine.data(), mine.size(), all.data());
  interleave_column_blocks(all.data(), comm.size(), M, part, logits);
}

}  // namespace meshtune
