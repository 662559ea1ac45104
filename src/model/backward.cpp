#include "model/backward.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "model/token_rows.h"

namespace meshtune {

// A gradient the backward adds into (host memory: the Trainer's), as an operand of n values; empty
// when the variable is frozen.
// A gradient slot of ModelGradients (in the backend's memory), or none.
static Floats gradient(const Backend& b, float* g, int64_t n) { return g ? Floats(g, size_t(n), b.device()) : Floats(); }

// One projection of project()'s input: its slot, matrix, output gradient and ∂W slot (full fine-tuning).
struct ProjectionGradient {
  Slot slot;
  const WeightMatrix& W;
  ConstFloats dy;
  float* grad_w;
};

// Backward of project() over projections of one input x: dx (+)= Σ dy·W (one call for all: a GPU
// narrows the dys together), then each LoRA term's share; ∂W += dyᵀ·x where `grad_w` (full
// fine-tuning); the LoRA terms add their ∂A and ∂B (W itself is never differentiated under LoRA).
static void project_backward(const Context& ctx, const GemmaModel& model, int layer, ConstFloats x, int64_t M,
                             std::initializer_list<ProjectionGradient> projections, Floats dx, bool accumulate) {
  Backend& b = ctx.backend;
  std::vector<LinearOutputGradient> products;
  for (const ProjectionGradient& p : projections) products.push_back({&p.W, p.dy});
  b.linear_backward_input(products, M, dx, accumulate, ctx.precision);
  for (const ProjectionGradient& p : projections) {
    if (p.grad_w) b.linear_backward_weight(p.dy, x, M, p.W.rows, p.W.cols, gradient(b, p.grad_w, p.W.rows * p.W.cols));
    b.low_rank_backward(x, p.dy, M, model.low_rank_term(layer, p.slot), dx);
  }
}

// Backward of one decoder block (mirror of decoder_block in gemma.cpp). On entry dx holds
// ∂L/∂(block output) [M, D]; on exit ∂L/∂(block input). Weight gradients are added into g.
static void decoder_block_backward(const Context& ctx, const GemmaModel& model, const DecoderLayerWeights& w,
                                   int layer, const BlockActivations& a, int64_t B, int64_t T,
                                   Span<const uint8_t> key_valid, const LayerGradients& g, FloatBuffer& dx,
                                   TrainingWorkspace& ws) {
  Backend& b = ctx.backend;
  const GemmaConfig& c = model.config;
  const int64_t M = B * T, D = c.hidden_dim, N = c.num_query_heads, K = c.num_key_value_heads, H = c.head_dim,
                F = c.ffw_dim;
  const float eps = c.layer_norm_epsilon;
  // Workspace buffers: each is overwritten by the op that produces it (none accumulates into
  // stale values), so they are sized but not cleared.
  auto sized = [&b](FloatBuffer& v, int64_t n) -> FloatBuffer& {
    b.resize(v, size_t(n));
    return v;
  };

  // ∂L/∂branch of a branch joining the residual stream: dx itself, or dx through the post-norm (into
  // d_branch: dx stays ∂L/∂(the residual) for the join's other side).
  const auto branch_gradient = [&](bool post_norm, const FloatBuffer& branch, const WeightVector& scale,
                                   float* scale_gradient) -> ConstFloats {
    if (!post_norm) return dx;
    FloatBuffer& d_branch = sized(ws.d_branch, M * D);
    b.rmsnorm_backward(branch, scale, M, D, eps, dx, d_branch, gradient(b, scale_gradient, D));
    return d_branch;
  };

  // --- feed-forward branch: out = mid + post_ffw_norm(ffw_linear(gelu(gate)·up)) ---
  ConstFloats d_branch = branch_gradient(c.use_post_ffw_norm, a.ffw_projected, w.post_ffw_norm, g.post_ffw_norm);
  FloatBuffer& d_activated = sized(ws.d_activated, M * F);
  FloatBuffer& d_normed = sized(ws.d_normed, M * D);
  if (a.gate_up_bf16) {
    // Gate and up kept in bf16 (nothing differentiates the feed-forward's matrices): their gradients
    // are only the bf16 products' input, and are written so.
    b.linear_backward_input(d_branch, M, w.ffw_linear, d_activated, false, ctx.precision);
    const Span<const uint16_t> kept = *a.gate_up_bf16;
    Bf16Buffer& d_gate_up = ws.d_gate_up_bf16;
    b.resize(d_gate_up, size_t(2 * M * F));
    const Span<uint16_t> d_gate = d_gate_up.span().part(0, size_t(M * F)),
                         d_up = d_gate_up.span().part(size_t(M * F), size_t(M * F));
    b.geglu_backward_bf16(kept.part(0, size_t(M * F)), kept.part(size_t(M * F), size_t(M * F)), d_activated, M * F,
                          d_gate, d_up);
    b.linear_backward_input({{&w.ffw_gating, d_gate}, {&w.ffw_gating_2, d_up}}, M, d_normed, false);
  } else {
    FloatBuffer &d_gate = sized(ws.d_gate, M * F), &d_up = sized(ws.d_up, M * F);
    // ffw_linear's input gelu(gate)·up was not kept (F wide); it is recomputed when there is a
    // gradient of ffw_linear to form (full fine-tuning, or a LoRA term on it).
    ConstFloats activated;
    if (g.ffw_linear || model.low_rank_term(layer, Slot::FfwLinear).active()) {
      FloatBuffer& act = sized(ws.activated, M * F);
      b.geglu(a.gate, a.up, M * F, act);
      activated = act;
    }
    project_backward(ctx, model, layer, activated, M, {{Slot::FfwLinear, w.ffw_linear, d_branch, g.ffw_linear}},
                     d_activated, false);
    b.geglu_backward(a.gate, a.up, d_activated, M * F, d_gate, d_up);
    project_backward(ctx, model, layer, a.ffw_normed, M,
                     {{Slot::FfwGating, w.ffw_gating, d_gate, g.ffw_gating},
                      {Slot::FfwGating2, w.ffw_gating_2, d_up, g.ffw_gating_2}},
                     d_normed, false);
  }
  ctx.tensor_parallel.sum_partials(d_normed);  // Σ over width
  // dx += the normed input's gradient through the pre-norm: now ∂L/∂mid.
  b.rmsnorm_backward(a.mid, w.pre_ffw_norm, M, D, eps, d_normed, dx, gradient(b, g.pre_ffw_norm, D),
                     /*accumulate=*/true);

  // --- attention branch: mid = input + post_attention_norm(attention_output(attention(q, k, v))) ---
  d_branch = branch_gradient(c.use_post_attention_norm, a.attn_projected, w.post_attention_norm,
                             g.post_attention_norm);
  FloatBuffer& d_attended = sized(ws.d_attended, M * N * H);
  project_backward(ctx, model, layer, a.attended, M,
                   {{Slot::AttentionOutput, w.attention_output, d_branch, g.attention_output}}, d_attended, false);
  FloatBuffer &dq = sized(ws.dq, M * N * H), &dk = sized(ws.dk, M * K * H), &dv = sized(ws.dv, M * K * H);
  b.attention_backward(a.q, a.k, a.v, key_valid, attention_shape(c, layer, B, T, 0, T, ctx.precision), d_attended, dq, dk, dv);
  const Span<const int64_t> positions = ws.forward.positions;  // the forward pass' (start 0)
  b.rope_backward(dq, N, dk, K, M, H, positions, c.rope_base(layer), c.rope_scaling(layer), c.query_scale());
  if (c.use_query_key_norm) {
    b.rmsnorm_backward(a.q_raw, w.query_norm, M * N, H, eps, dq, dq, gradient(b, g.query_norm, H));
    b.rmsnorm_backward(a.k_raw, w.key_norm, M * K, H, eps, dk, dk, gradient(b, g.key_norm, H));
  }
  project_backward(ctx, model, layer, a.attn_normed, M,
                   {{Slot::Query, w.query, dq, g.query}, {Slot::Key, w.key, dk, g.key}, {Slot::Value, w.value, dv, g.value}},
                   d_normed, false);
  ctx.tensor_parallel.sum_partials(d_normed);  // Σ over heads
  // dx += the normed input's gradient through the pre-norm: now ∂L/∂input.
  b.rmsnorm_backward(a.input, w.pre_attention_norm, M, D, eps, d_normed, dx, gradient(b, g.pre_attention_norm, D),
                     /*accumulate=*/true);
}

float*& ModelGradients::of(Slot slot, int layer) {
  if (slot == Slot::Embeddings) return embeddings;
  if (slot == Slot::FinalNorm) return final_norm;
  LayerGradients& g = layers[size_t(layer)];
  switch (slot) {
    case Slot::Query: return g.query;
    case Slot::Key: return g.key;
    case Slot::Value: return g.value;
    case Slot::AttentionOutput: return g.attention_output;
    case Slot::FfwGating: return g.ffw_gating;
    case Slot::FfwGating2: return g.ffw_gating_2;
    case Slot::FfwLinear: return g.ffw_linear;
    case Slot::PreAttentionNorm: return g.pre_attention_norm;
    case Slot::PostAttentionNorm: return g.post_attention_norm;
    case Slot::PreFfwNorm: return g.pre_ffw_norm;
    case Slot::PostFfwNorm: return g.post_ffw_norm;
    case Slot::QueryNorm: return g.query_norm;
    case Slot::KeyNorm: return g.key_norm;
    default: break;
  }
  fail("no gradient slot");
}

// Whether no block's feed-forward matrix gets a gradient (no ∂W, no LoRA term) and none is int8:
// then backward reads gate and up only for GeGLU's gradient, and its gradients only bf16 products
// take under the bf16 policies, so blocks keep gate and up in bf16 themselves (gate_up_bf16).
static bool feed_forward_undifferentiated(const GemmaModel& model, const ModelGradients& grads) {
  for (int layer = 0; layer < model.config.num_layers; ++layer) {
    const LayerGradients& g = grads.layers[size_t(layer)];
    if (g.ffw_gating || g.ffw_gating_2 || g.ffw_linear) return false;
    for (Slot slot : {Slot::FfwGating, Slot::FfwGating2, Slot::FfwLinear}) {
      if (model.low_rank_term(layer, slot).active()) return false;
      const WeightMatrix* W = model.matrix(slot, layer);
      if (!W || W->dtype == DType::I8) return false;
    }
  }
  return true;
}

LossSums forward_backward(const Context& ctx, const GemmaModel& model, const TokenBatch& batch, double loss_scale,
                          const ModelGradients* grads, TrainingWorkspace* workspace) {
  Backend& b = ctx.backend;
  TrainingWorkspace local;
  TrainingWorkspace& ws = workspace ? *workspace : local;
  const GemmaConfig& c = model.config;
  const int64_t B = batch.batch, T = batch.length, M = B * T, D = c.hidden_dim, V = c.vocab_size;
  check(B > 0 && T > 0, "empty training batch");
  check(!grads || int64_t(grads->layers.size()) == c.num_layers, "gradient table has the wrong number of layers");
  if (const int64_t m = first_id_outside(batch.targets, M, V); m >= 0)
    fail("target id ", batch.targets[m], " at [", m / T, ", ", m % T, "] is outside the vocabulary (size ", V, ")");

  KVCache& cache = ws.cache;
  cache.resize(c, B, T, b, /*keep_keys=*/false);  // attention reads each block's own keys and values
  cache.set_key_valid(b, Span<const uint8_t>(batch.padding_mask, size_t(M)));
  // Under mixed_bfloat16 the blocks' activations are kept in bf16 (half the memory), as Keras keeps
  // them in its compute dtype.
  SavedBlocks& saved = ws.blocks;
  const bool bf16 = ctx.precision == MatmulPrecision::BF16;
  if (grads) saved.start(b, c.num_layers, bf16, bf16 && feed_forward_undifferentiated(model, *grads));
  const FloatBuffer& hidden = backbone_forward(ctx, model, batch.token_ids, B, T, 0, cache, ws.forward, nullptr,
                                              grads ? &saved : nullptr, grads ? &ws.final_norm_input : nullptr);

  // Loss over the rows that carry weight, a chunk at a time (the logits of a chunk only). With the
  // vocabulary split over processes each holds its columns of the logits, and the softmax's max,
  // sum and target logit are combined over the processes (backend/cpu/cross_entropy.h).
  const WeightedRows weighted = weighted_rows(batch.targets, batch.sample_weight, M);
  const size_t R = weighted.rows.size();
  b.resize(ws.loss_rows, std::max<size_t>(R, 1));
  b.resize(ws.loss_targets, std::max<size_t>(R, 1));
  b.resize(ws.loss_weights, std::max<size_t>(R, 1));
  b.upload(Span<const int64_t>(weighted.rows), ws.loss_rows);
  b.upload(Span<const int32_t>(weighted.targets), ws.loss_targets);
  b.upload(Span<const float>(weighted.weights), ws.loss_weights);
  b.resize(ws.loss_sums, 3);
  const double zeros[3] = {0, 0, 0};
  b.upload(Span<const double>(zeros, 3), ws.loss_sums);
  const int64_t part = model.embeddings.rows, v0 = model.vocab_offset;  // this process' vocabulary rows
  const bool vocab_split = model.vocab_parallel();
  const int64_t chunk = loss_chunk_rows(part);
  // Rows with zero weight get no gradient: d_hidden starts at zero, the chunks scatter into it.
  FloatBuffer& d_hidden = ws.d_hidden;
  if (grads) {
    b.resize_zeroed(d_hidden, size_t(M * D));
  }
  FloatBuffer &h_chunk = ws.h_chunk, &d_h_chunk = ws.d_h_chunk, &logits = ws.logits;  // overwritten chunk by chunk
  b.resize(h_chunk, size_t(chunk * D));
  b.resize(d_h_chunk, size_t(chunk * D));
  b.resize(logits, size_t(chunk * part));
  SoftmaxRows& stats = ws.loss_stats;
  for (size_t r0 = 0; r0 < R; r0 += size_t(chunk)) {
    const int64_t n = std::min<int64_t>(chunk, int64_t(R - r0));
    const Span<const int64_t> chunk_rows = ws.loss_rows.span().part(r0, size_t(n));
    const Span<const int32_t> targets = ws.loss_targets.span().part(r0, size_t(n));
    const ConstFloats weights = ws.loss_weights.span().part(r0, size_t(n));
    b.gather_rows(hidden, chunk_rows, D, h_chunk);
    lm_head_local(ctx, model, h_chunk, n, logits);
    b.softmax_row_max(logits, n, part, v0, stats);
    if (vocab_split) ctx.tensor_parallel.combine_row_max(b, stats, n);  // the first process with the maximum wins
    b.softmax_row_sums(logits, n, part, v0, targets, stats);
    if (vocab_split) ctx.tensor_parallel.sum_row_sums(stats, n);
    b.softmax_cross_entropy_sums(stats, targets, weights, n, ws.loss_sums);
    if (!grads) continue;
    // The chunk's logits buffer becomes ∂L/∂raw_logits, then flows into the hidden states and the
    // tied embedding.
    b.softmax_cross_entropy_backward(logits, n, part, v0, targets, weights, loss_scale, stats, c.final_logit_soft_cap);
    b.linear_backward_input(logits, n, model.embeddings, d_h_chunk, false, ctx.precision);
    if (vocab_split) ctx.tensor_parallel.sum_partials(d_h_chunk.span().part(0, size_t(n * D)));  // Σ over parts
    if (grads->embeddings)
      b.linear_backward_weight(logits, h_chunk, n, part, D, gradient(b, grads->embeddings, part * D));
    b.scatter_rows(d_h_chunk, chunk_rows, D, d_hidden);
  }
  double sums[3];  // Σ w·CE, Σ w·correct, Σ w
  b.download(ws.loss_sums.span(), Span<double>(sums, 3));
  const LossSums totals{sums[0], sums[1], sums[2]};
  if (!grads) return totals;

  // Final norm, then the blocks in reverse, then the scaled embedding lookup.
  FloatBuffer& dx = d_hidden;
  b.rmsnorm_backward(ws.final_norm_input, model.final_norm, M, D, c.layer_norm_epsilon, dx, dx,
                     gradient(b, grads->final_norm, D));
  const Span<const uint8_t> key_valid = cache.key_valid;  // the batch's padding mask, on the backend
  for (int layer = c.num_layers - 1; layer >= 0; --layer)
    decoder_block_backward(ctx, model, model.layer_weights(layer), layer, saved.backward_set(layer), B, T, key_valid,
                           grads->layers[size_t(layer)], dx, ws);
  if (grads->embeddings)  // x = Emb[ids]·√D
    b.embedding_lookup_backward(dx, ws.forward.ids, M, D, model.vocab_offset,
                                model.embeddings.rows, float(std::sqrt(double(D))), gradient(b, grads->embeddings, part * D));
  return totals;
}

}  // namespace meshtune
