#include "model/gemma.h"

#include <array>
#include <cmath>

#include "core/error.h"
#include "model/token_rows.h"

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

GemmaModel upload_model(const GemmaModel& model, Backend& backend) {
  check(!model.layer_source, "upload_model: the model's blocks are built on demand (a sharded model); "
        "only whole weights are uploaded");
  GemmaModel out = model;
  for (const VariableSpec& spec : gemma_variables(model.config)) {
    if (WeightMatrix* w = out.matrix(spec.slot, spec.layer)) *w = backend.upload(*w);
    else if (WeightVector* v = out.vector(spec.slot, spec.layer)) *v = backend.upload(*v);
  }
  return out;
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

WeightVector* DecoderLayerWeights::vector(Slot slot) {
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
static bool input_is_split(const Context& ctx, Slot slot) {
  return ctx.tensor_parallel.active() && (slot == Slot::AttentionOutput || slot == Slot::FfwLinear);
}

void project(const Context& ctx, const GemmaModel& model, int layer, ConstFloats x, int64_t M,
             std::initializer_list<Projection> projections) {
  Backend& b = ctx.backend;
  std::vector<LinearOutput> shared;
  for (const Projection& p : projections) {
    if (p.W.dtype == DType::I8 && input_is_split(ctx, p.slot)) {
      FloatBuffer token_max;
      b.resize(token_max, size_t(M));
      b.row_abs_max(x, M, p.W.cols, token_max);
      ctx.tensor_parallel.max_over_slices(token_max);
      b.linear(x, M, p.W, p.y, ctx.precision, token_max);
    } else {
      shared.push_back({&p.W, p.y});
    }
  }
  b.linear(x, M, shared, ctx.precision);
  for (const Projection& p : projections) {
    const LowRankTerm& lora = model.low_rank_term(layer, p.slot);
    if (!lora.active()) continue;
    check(lora.in == p.W.cols && lora.out() == p.W.rows, "LoRA term of decoder_block_", layer, "/", int(p.slot),
          " is ", lora.out(), "×", lora.in, " but its matrix is ", p.W.rows, "×", p.W.cols);
    b.low_rank(x, M, lora, p.y);
  }
}

WeightMatrix* GemmaModel::matrix(Slot slot, int layer) {
  if (slot == Slot::Embeddings) return &embeddings;
  return layer >= 0 ? layers[size_t(layer)].matrix(slot) : nullptr;
}

WeightVector* GemmaModel::vector(Slot slot, int layer) {
  if (slot == Slot::FinalNorm) return &final_norm;
  return layer >= 0 ? layers[size_t(layer)].vector(slot) : nullptr;
}

void KVCache::resize(const GemmaConfig& c, int64_t b, int64_t s, Backend& backend, bool keep_keys) {
  batch = b;
  capacity = s;
  const size_t per_layer = size_t(b) * size_t(s) * size_t(c.num_key_value_heads) * size_t(c.head_dim);
  const size_t layers = keep_keys ? size_t(c.num_layers) : 0;
  keys.resize(layers);
  values.resize(layers);
  for (size_t layer = 0; layer < layers; ++layer) {
    backend.resize(keys[layer], per_layer);
    backend.resize(values[layer], per_layer);
  }
  backend.resize(key_valid, size_t(b) * size_t(s));
}

KVCache::KVCache(const GemmaConfig& c, int64_t b, int64_t s, Backend& backend, bool keep_keys) {
  resize(c, b, s, backend, keep_keys);
  set_key_valid(backend, std::vector<uint8_t>(size_t(b) * size_t(s), 1));
}

void KVCache::set_key_valid(Backend& backend, Span<const uint8_t> host) {
  check(host.size == size_t(batch) * size_t(capacity), "KV cache: ", host.size, " key flags for a cache of ", batch,
        " × ", capacity);
  backend.upload(host, key_valid);
}

AttentionShape attention_shape(const GemmaConfig& c, int layer, int64_t B, int64_t T, int64_t start, int64_t S,
                               MatmulPrecision precision) {
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
  shape.bf16_products = precision == MatmulPrecision::BF16;
  return shape;
}

// What a block hands on to be added into the residual stream: a branch, normalized by its post-norm
// first where the family has one (Gemma 2/3) — inside the join's own op.
struct Branch {
  ConstFloats values, post_norm;  // post_norm empty: none
  bool empty() const { return values.empty(); }
};

// x += branch (if any), then y = RMSNorm(x)·(1 + scale), in one op; `kept` (if given) receives the new x.
static void join_and_norm(Backend& b, FloatBuffer& x, const Branch& branch, ConstFloats scale, int64_t M, int64_t D,
                          float eps, Floats y, Floats kept) {
  if (!branch.empty()) return b.add_rmsnorm(x, branch.values, scale, M, D, eps, y, kept, branch.post_norm);
  b.rmsnorm(x, scale, M, D, eps, y);
  if (!kept.empty()) b.copy(x, M * D, kept);
}

// One decoder block on the residual stream x [M = B·T, D]; `a` receives the block's intermediate
// values — all of them when the caller keeps them for backward (`for_backward`); otherwise the
// residual stream's copies (input, mid) are not made and GeGLU runs in place on `gate`. The block
// starts by adding `pending` (the previous block's feed-forward branch, or nothing) into x, in one
// op with its first norm, and returns its own feed-forward branch for the caller to add — into the
// next block's first norm, or the final one: one launch fewer per block on a GPU (two with a
// post-norm). What it returns lives in `a` until the next block's first op has read it.
static Branch decoder_block(const Context& ctx, const GemmaModel& model, const DecoderLayerWeights& w, int layer,
                            FloatBuffer& x, const Branch& pending, Span<const int64_t> positions, int64_t B, int64_t T,
                            int64_t start, KVCache& cache, BlockActivations& a, BlockScratch& s, bool for_backward) {
  Backend& b = ctx.backend;
  const GemmaConfig& c = model.config;
  const int64_t M = B * T, D = c.hidden_dim, N = c.num_query_heads, K = c.num_key_value_heads, H = c.head_dim,
                F = c.ffw_dim, S = cache.capacity;
  const float eps = c.layer_norm_epsilon;
  // Every buffer is overwritten by its producer, so a reused one keeps its memory and is not cleared.
  auto buffer = [&b](FloatBuffer& v, int64_t n) { b.resize(v, size_t(n)); };
  // A branch and its post-norm, if the family has one.
  const auto branch = [](const FloatBuffer& values, bool use_post_norm, const WeightVector& post_norm) {
    return Branch{values, use_post_norm ? ConstFloats(post_norm) : ConstFloats()};
  };

  // --- attention ---
  buffer(a.attn_normed, M * D);
  buffer(a.q, M * N * H);
  buffer(a.k, M * K * H);
  buffer(a.v, M * K * H);
  // Kept for backward: the residual stream entering the block (`input`) and after its attention
  // branch (`mid`), written by the joins themselves (x_copy) — the first block copies its input.
  if (for_backward) buffer(a.input, M * D), buffer(a.mid, M * D);
  const auto kept = [&](FloatBuffer& v) { return for_backward ? Floats(v) : Floats(); };
  join_and_norm(b, x, pending, w.pre_attention_norm, M, D, eps, a.attn_normed, kept(a.input));
  // RoPE also writes this step's keys/values into the cache at [b, start + t]; a cache of one pass
  // keeps none, and attention reads the step's own ([B, T = S, K·H], the cache's layout).
  ConstFloats keys = a.k, values = a.v;
  CacheWrite into_cache;
  const CacheWrite* cache_write = nullptr;
  if (cache.keeps_keys()) {
    FloatBuffer &cache_k = cache.keys[size_t(layer)], &cache_v = cache.values[size_t(layer)];
    into_cache = {a.v, B, S, start, cache_k, cache_v};
    cache_write = &into_cache;
    keys = cache_k, values = cache_v;
  }
  const RopeStep rope{N, K, H, positions, c.rope_base(layer), c.rope_scaling(layer), c.query_scale(), cache_write};
  const bool qk_norm = c.use_query_key_norm;
  const bool qkv_adapted = model.low_rank_term(layer, Slot::Query).active() ||
                           model.low_rank_term(layer, Slot::Key).active() ||
                           model.low_rank_term(layer, Slot::Value).active();
  if (!qk_norm && !qkv_adapted) {  // nothing reads q and k before RoPE: a GPU decodes this in one launch
    b.linear_rope(a.attn_normed, M, w.query, w.key, w.value, a.q, a.k, a.v, rope, ctx.precision);
  } else {  // Gemma 3 normalizes q and k per head before RoPE: its projections go to q_raw / k_raw first
    if (qk_norm) buffer(a.q_raw, M * N * H), buffer(a.k_raw, M * K * H);
    project(ctx, model, layer, a.attn_normed, M,
            {{Slot::Query, w.query, qk_norm ? a.q_raw : a.q},
             {Slot::Key, w.key, qk_norm ? a.k_raw : a.k},
             {Slot::Value, w.value, a.v}});
    if (qk_norm) {
      b.rmsnorm(a.q_raw, w.query_norm, M * N, H, eps, a.q);
      b.rmsnorm(a.k_raw, w.key_norm, M * K, H, eps, a.k);
    }
    b.rope(a.q, N, a.k, K, M, H, positions, rope.base, rope.scaling, rope.q_scale, cache_write);
  }

  buffer(a.attended, M * N * H);
  buffer(a.attn_projected, M * D);
  b.attention(a.q, keys, values, cache.key_valid, attention_shape(c, layer, B, T, start, S, ctx.precision), a.attended);
  project(ctx, model, layer, a.attended, M, {{Slot::AttentionOutput, w.attention_output, a.attn_projected}});
  ctx.tensor_parallel.sum_partials(a.attn_projected);  // Σ over heads
  // The attention branch joins the residual stream and the feed-forward's input is normalized, in one op.
  buffer(a.ffw_normed, M * D);
  join_and_norm(b, x, branch(a.attn_projected, c.use_post_attention_norm, w.post_attention_norm), w.pre_ffw_norm, M,
                D, eps, a.ffw_normed, kept(a.mid));

  // --- feed-forward (GeGLU) ---
  buffer(a.gate, M * F);
  buffer(a.up, M * F);
  buffer(a.ffw_projected, M * D);
  if (for_backward && a.gate_up_bf16) {
    // Only bf16 products and backward's bf16 copies read the M·F values here: GeGLU writes them in
    // bf16 (the same numbers as geglu, then each narrowed), and the down projection takes them so.
    project(ctx, model, layer, a.ffw_normed, M,
            {{Slot::FfwGating, w.ffw_gating, a.gate}, {Slot::FfwGating2, w.ffw_gating_2, a.up}});
    Bf16Buffer& kept = *a.gate_up_bf16;
    b.resize(kept, size_t(2 * M * F));
    b.resize(s.activated_bf16, size_t(M * F));
    b.geglu_to_bf16(a.gate, a.up, M * F, s.activated_bf16, kept.span().part(0, size_t(M * F)),
                    kept.span().part(size_t(M * F), size_t(M * F)));
    b.linear(s.activated_bf16, M, w.ffw_linear, a.ffw_projected);
  } else {
    FloatBuffer& activated = for_backward ? s.activated : a.gate;  // backward needs gate itself
    if (for_backward) buffer(activated, M * F);
    const bool ffw_adapted = model.low_rank_term(layer, Slot::FfwGating).active() ||
                             model.low_rank_term(layer, Slot::FfwGating2).active();
    if (!for_backward && !ffw_adapted) {  // nothing else reads gate and up: a GPU decodes this in one launch
      b.linear_geglu(a.ffw_normed, M, w.ffw_gating, w.ffw_gating_2, a.gate, a.up, activated, ctx.precision);
    } else {
      project(ctx, model, layer, a.ffw_normed, M,
              {{Slot::FfwGating, w.ffw_gating, a.gate}, {Slot::FfwGating2, w.ffw_gating_2, a.up}});
      b.geglu(a.gate, a.up, M * F, activated);
    }
    project(ctx, model, layer, activated, M, {{Slot::FfwLinear, w.ffw_linear, a.ffw_projected}});
  }
  ctx.tensor_parallel.sum_partials(a.ffw_projected);  // Σ over width
  return branch(a.ffw_projected, c.use_post_ffw_norm, w.post_ffw_norm);
}

// The buffers of a block's activations (const or not), in a fixed order (for SavedBlocks' bf16 copies).
template <class Activations>
static auto activation_buffers(Activations& a) {
  const std::array buffers{&a.input, &a.attn_normed, &a.q_raw, &a.k_raw, &a.q, &a.k, &a.v, &a.attended,
                           &a.attn_projected, &a.mid, &a.ffw_normed, &a.gate, &a.up, &a.ffw_projected};
  static_assert(buffers.size() == SavedBlocks::kBuffers);
  return buffers;
}

void SavedBlocks::start(Backend& backend, int layers, bool bf16, bool feed_forward_bf16) {
  check(bf16 || !feed_forward_bf16, "SavedBlocks: gate and up are kept in bf16 only under a bf16 policy");
  backend_ = &backend;
  bf16_ = bf16;
  feed_forward_bf16_ = feed_forward_bf16;
  fp32_.resize(bf16 ? 1 : size_t(layers));
  packed_.resize(bf16 ? size_t(layers) : 0);
  sizes_.resize(bf16 ? size_t(layers) : 0);
  gate_up_.resize(feed_forward_bf16 ? size_t(layers) : 0);
}

size_t SavedBlocks::bytes() const {
  size_t total = 0;
  for (const BlockActivations& set : fp32_)
    for (const FloatBuffer* b : activation_buffers(set)) total += b->size() * sizeof(float);
  for (const Bf16Buffer& packed : packed_) total += packed.size() * sizeof(uint16_t);
  for (const Bf16Buffer& kept : gate_up_) total += kept.size() * sizeof(uint16_t);
  return total;
}

BlockActivations& SavedBlocks::working_set(int layer) {
  BlockActivations& a = fp32_[bf16_ ? 0 : size_t(layer)];
  a.gate_up_bf16 = feed_forward_bf16_ ? &gate_up_[size_t(layer)] : nullptr;
  return a;
}

BlockActivations& SavedBlocks::forward_set(int layer) { return working_set(layer); }

void SavedBlocks::keep(int layer) {
  if (!bf16_) return;
  const auto buffers = activation_buffers(fp32_[0]);
  size_t total = 0;
  std::vector<ConstFloats> parts;
  for (size_t i = 0; i < kBuffers; ++i) {
    // gate and up are in gate_up_bf16 already, where the block kept them there.
    const bool kept_apart = feed_forward_bf16_ && (buffers[i] == &fp32_[0].gate || buffers[i] == &fp32_[0].up);
    total += sizes_[size_t(layer)][i] = kept_apart ? 0 : buffers[i]->size();
    parts.push_back(ConstFloats(*buffers[i]).part(0, sizes_[size_t(layer)][i]));
  }
  Bf16Buffer& packed = packed_[size_t(layer)];
  backend_->resize(packed, total);
  backend_->narrow_to_bf16(parts, packed);
}

const BlockActivations& SavedBlocks::backward_set(int layer) {
  BlockActivations& a = working_set(layer);
  if (!bf16_) return a;
  const auto buffers = activation_buffers(a);
  std::vector<Floats> parts;
  for (size_t i = 0; i < kBuffers; ++i) {
    backend_->resize(*buffers[i], sizes_[size_t(layer)][i]);
    parts.push_back(*buffers[i]);
  }
  backend_->widen_bf16(packed_[size_t(layer)], parts);
  return a;
}

const FloatBuffer& backbone_forward(const Context& ctx, const GemmaModel& model, const int32_t* tokens, int64_t B,
                                    int64_t T, int64_t start, KVCache& cache, ForwardWorkspace& ws,
                                    ForwardTrace* trace, SavedBlocks* saved, FloatBuffer* final_norm_input) {
  Backend& b = ctx.backend;
  const int64_t M = B * T;
  if (const int64_t m = first_id_outside(tokens, M, model.config.vocab_size); m >= 0)
    fail("token id ", tokens[m], " at [", m / T, ", ", m % T, "] is outside the vocabulary (size ",
         model.config.vocab_size, ")");
  // The pass' ids and positions cross to the backend once.
  b.resize(ws.ids, size_t(M));
  b.upload(Span<const int32_t>(tokens, size_t(M)), ws.ids);
  b.resize(ws.positions, size_t(M));
  b.upload(token_positions(B, T, start), ws.positions);
  return backbone_forward(ctx, model, ws.ids, ws.positions, B, T, start, cache, ws, trace, saved, final_norm_input);
}

const FloatBuffer& backbone_forward(const Context& ctx, const GemmaModel& model, Span<const int32_t> ids,
                                    Span<const int64_t> positions, int64_t B, int64_t T, int64_t start,
                                    KVCache& cache, ForwardWorkspace& ws, ForwardTrace* trace, SavedBlocks* saved,
                                    FloatBuffer* final_norm_input) {
  Backend& b = ctx.backend;
  const GemmaConfig& c = model.config;
  const int64_t D = c.hidden_dim, M = B * T;
  check(B <= cache.batch && start + T <= cache.capacity, "KV cache too small: ", B, " rows × ", start + T,
        " positions needed, ", cache.batch, " × ", cache.capacity, " allocated");
  check(cache.keeps_keys() || (B == cache.batch && start == 0 && T == cache.capacity), "a KV cache of one pass (",
        cache.batch, " × ", cache.capacity, ") serves only a pass that fills it, not ", B, " rows at ", start, " … ",
        start + T - 1);
  check(ids.size >= size_t(M) && positions.size >= size_t(M), "backbone_forward: ", ids.size, " ids and ",
        positions.size, " positions for ", M, " tokens");
  FloatBuffer& x = ws.x;  // the residual stream
  b.resize(x, size_t(M * D));
  auto copy_out = [&](std::vector<float>& host) {  // a host crossing, for the trace
    host.resize(size_t(M * D));
    b.download(x, host);
  };
  // Gemma scales the embeddings by √D (rounded to the compute dtype first): in the lookup's own call,
  // except for a trace, which keeps the rows before and after.
  const float embedding_scale = float(std::sqrt(double(D)));
  b.embedding_lookup(model.embeddings, model.vocab_offset, ids, M, x, trace ? 1.f : embedding_scale);
  // Vocabulary split: each row came from one process, the others hold zeros there (scaled, still zeros).
  if (model.vocab_parallel()) ctx.tensor_parallel.sum_partials(x);
  if (trace) {
    copy_out(trace->embedding_lookup);
    b.scale(x, M * D, embedding_scale);
    copy_out(trace->embedding_scaled);
  }

  Branch pending;  // the last block's feed-forward branch, not yet in x
  const auto join_pending = [&] {  // on its own, for the trace
    if (pending.empty()) return;
    ConstFloats values = pending.values;
    if (!pending.post_norm.empty()) {
      b.resize(ws.scratch.residual, size_t(M * D));
      b.rmsnorm(values, pending.post_norm, M, D, c.layer_norm_epsilon, ws.scratch.residual);
      values = ws.scratch.residual;
    }
    b.add_into(x, values, M * D);
    pending = {};
  };
  for (int layer = 0; layer < c.num_layers; ++layer) {
    BlockActivations& a = saved ? saved->forward_set(layer) : ws.unsaved;
    pending = decoder_block(ctx, model, model.layer_weights(layer), layer, x, pending, positions, B, T, start,
                            cache, a, ws.scratch, saved != nullptr);
    if (saved) saved->keep(layer);
    if (trace) {  // the block's output itself
      join_pending();
      copy_out(trace->block_outputs.emplace_back());
    }
  }
  FloatBuffer& hidden = ws.hidden;
  b.resize(hidden, size_t(M * D));
  // The last block's output (x after the join) is kept for backward where asked, by the join itself.
  if (final_norm_input) b.resize(*final_norm_input, size_t(M * D));
  join_and_norm(b, x, pending, model.final_norm, M, D, c.layer_norm_epsilon, hidden,
                final_norm_input ? Floats(*final_norm_input) : Floats());
  return hidden;
}

FloatBuffer backbone_forward(const Context& ctx, const GemmaModel& model, const int32_t* tokens, int64_t B, int64_t T,
                             int64_t start, KVCache& cache, ForwardTrace* trace) {
  ForwardWorkspace ws;
  backbone_forward(ctx, model, tokens, B, T, start, cache, ws, trace);
  return std::move(ws.hidden);
}

void lm_head_local(const Context& ctx, const GemmaModel& model, ConstFloats hidden, int64_t M, Floats logits) {
  ctx.backend.linear(hidden, M, model.embeddings, logits, ctx.precision);
  if (model.config.final_logit_soft_cap > 0)
    ctx.backend.soft_cap(logits, M * model.embeddings.rows, model.config.final_logit_soft_cap);
}

void lm_head(const Context& ctx, const GemmaModel& model, ConstFloats hidden, int64_t M, Floats logits) {
  if (!model.vocab_parallel()) return lm_head_local(ctx, model, hidden, M, logits);
  // Each process' columns, gathered (in process = vocabulary order) and laid out row by row.
  const int64_t part = model.embeddings.rows;
  FloatBuffer mine, all;
  ctx.backend.resize(mine, size_t(M * part));
  ctx.backend.resize(all, size_t(M * part) * size_t(ctx.tensor_parallel.size()));
  lm_head_local(ctx, model, hidden, M, mine);
  ctx.tensor_parallel.gather_columns(ctx.backend, mine, M, part, all, logits);
}

}  // namespace meshtune
