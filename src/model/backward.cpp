#include "model/backward.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/activation.h"
#include "kernels/cross_entropy.h"
#include "kernels/linear.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "kernels/tensor_ops.h"

namespace meshtune {

// Backward of project(): dx (+)= dy·W plus the LoRA term's share; ∂W += dyᵀ·x when `grad_w` (full
// fine-tuning); the LoRA term adds its ∂A and ∂B (W itself is never differentiated under LoRA).
static void project_backward(const GemmaModel& model, int layer, Slot slot, const float* x, const float* dy, int64_t M,
                             const WeightMatrix& W, float* dx, bool accumulate, float* grad_w) {
  linear_backward_input(dy, M, W, dx, accumulate, model.matmul_precision);
  if (grad_w) linear_backward_weight(dy, x, M, W.rows, W.cols, grad_w);
  low_rank_backward(x, dy, M, model.low_rank_term(layer, slot), dx);
}

// Backward of one decoder block (mirror of decoder_block in gemma.cpp). On entry dx holds
// ∂L/∂(block output) [M, D]; on exit ∂L/∂(block input). Weight gradients are added into g.
static void decoder_block_backward(const GemmaModel& model, const DecoderLayerWeights& w, int layer,
                                   const BlockActivations& a, int64_t B, int64_t T, const uint8_t* key_valid,
                                   const LayerGradients& g, FloatBuffer& dx, TrainingWorkspace& ws) {
  const GemmaConfig& c = model.config;
  const int64_t M = B * T, D = c.hidden_dim, N = c.num_query_heads, K = c.num_key_value_heads, H = c.head_dim,
                F = c.ffw_dim;
  const float eps = c.layer_norm_epsilon;
  // Workspace buffers: each is overwritten by the kernel that produces it (none accumulates into
  // stale values), so they are sized but not cleared.
  auto sized = [](FloatBuffer& v, int64_t n) -> FloatBuffer& {
    v.resize(static_cast<size_t>(n));
    return v;
  };

  // --- feed-forward branch: out = mid + post_ffw_norm(ffw_linear(gelu(gate)·up)) ---
  FloatBuffer& d_branch = sized(ws.d_branch, M * D);
  copy_values(dx.data(), M * D, d_branch.data());
  if (c.use_post_ffw_norm)
    rmsnorm_backward(a.ffw_projected.data(), w.post_ffw_norm.data(), M, D, eps, d_branch.data(), d_branch.data(),
                     g.post_ffw_norm);
  FloatBuffer &d_activated = sized(ws.d_activated, M * F), &d_gate = sized(ws.d_gate, M * F),
              &d_up = sized(ws.d_up, M * F);
  // ffw_linear's input gelu(gate)·up was not kept (F wide); it is recomputed when there is a
  // gradient of ffw_linear to form (full fine-tuning, or a LoRA term on it).
  const float* activated = nullptr;
  if (g.ffw_linear || model.low_rank_term(layer, Slot::FfwLinear).active()) {
    FloatBuffer& act = sized(ws.activated, M * F);
    copy_values(a.gate.data(), M * F, act.data());
    geglu(act.data(), a.up.data(), M * F);
    activated = act.data();
  }
  project_backward(model, layer, Slot::FfwLinear, activated, d_branch.data(), M, w.ffw_linear, d_activated.data(),
                   false, g.ffw_linear);
  geglu_backward(a.gate.data(), a.up.data(), d_activated.data(), M * F, d_gate.data(), d_up.data());
  FloatBuffer& d_normed = sized(ws.d_normed, M * D);
  project_backward(model, layer, Slot::FfwGating, a.ffw_normed.data(), d_gate.data(), M, w.ffw_gating,
                   d_normed.data(), false, g.ffw_gating);
  project_backward(model, layer, Slot::FfwGating2, a.ffw_normed.data(), d_up.data(), M, w.ffw_gating_2,
                   d_normed.data(), /*accumulate=*/true, g.ffw_gating_2);
  if (model.tensor_parallel) model.tensor_parallel->all_reduce_sum(d_normed.data(), size_t(M * D));  // Σ over width
  rmsnorm_backward(a.mid.data(), w.pre_ffw_norm.data(), M, D, eps, d_normed.data(), d_normed.data(), g.pre_ffw_norm);
  add_into(dx.data(), d_normed.data(), M * D);  // now ∂L/∂mid

  // --- attention branch: mid = input + post_attention_norm(attention_output(attention(q, k, v))) ---
  copy_values(dx.data(), M * D, d_branch.data());
  if (c.use_post_attention_norm)
    rmsnorm_backward(a.attn_projected.data(), w.post_attention_norm.data(), M, D, eps, d_branch.data(),
                     d_branch.data(), g.post_attention_norm);
  FloatBuffer& d_attended = sized(ws.d_attended, M * N * H);
  project_backward(model, layer, Slot::AttentionOutput, a.attended.data(), d_branch.data(), M, w.attention_output,
                   d_attended.data(), false, g.attention_output);
  FloatBuffer &dq = sized(ws.dq, M * N * H), &dk = sized(ws.dk, M * K * H), &dv = sized(ws.dv, M * K * H);
  attention_backward(a.q.data(), a.k.data(), a.v.data(), key_valid, attention_shape(c, layer, B, T, 0, T),
                     d_attended.data(), dq.data(), dk.data(), dv.data());
  const float scale = c.query_scale();
  scale_in_place(dq.data(), M * N * H, scale);
  const std::vector<int64_t> positions = token_positions(B, T, 0);
  rope_backward(dq.data(), M, N, H, positions.data(), c.rope_base(layer), c.rope_scaling(layer));
  rope_backward(dk.data(), M, K, H, positions.data(), c.rope_base(layer), c.rope_scaling(layer));
  if (c.use_query_key_norm) {
    rmsnorm_backward(a.q_raw.data(), w.query_norm.data(), M * N, H, eps, dq.data(), dq.data(), g.query_norm);
    rmsnorm_backward(a.k_raw.data(), w.key_norm.data(), M * K, H, eps, dk.data(), dk.data(), g.key_norm);
  }
  project_backward(model, layer, Slot::Query, a.attn_normed.data(), dq.data(), M, w.query, d_normed.data(), false,
                   g.query);  // overwrites d_normed, the next two add to it
  project_backward(model, layer, Slot::Key, a.attn_normed.data(), dk.data(), M, w.key, d_normed.data(), true, g.key);
  project_backward(model, layer, Slot::Value, a.attn_normed.data(), dv.data(), M, w.value, d_normed.data(), true,
                   g.value);
  if (model.tensor_parallel) model.tensor_parallel->all_reduce_sum(d_normed.data(), size_t(M * D));  // Σ over heads
  rmsnorm_backward(a.input.data(), w.pre_attention_norm.data(), M, D, eps, d_normed.data(), d_normed.data(),
                   g.pre_attention_norm);
  add_into(dx.data(), d_normed.data(), M * D);  // now ∂L/∂input
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

LossSums forward_backward(const GemmaModel& model, const TokenBatch& batch, double loss_scale,
                          const ModelGradients* grads, TrainingWorkspace* workspace) {
  TrainingWorkspace local;
  TrainingWorkspace& ws = workspace ? *workspace : local;
  const GemmaConfig& c = model.config;
  const int64_t B = batch.batch, T = batch.length, M = B * T, D = c.hidden_dim, V = c.vocab_size;
  check(B > 0 && T > 0, "empty training batch");
  check(!grads || int64_t(grads->layers.size()) == c.num_layers, "gradient table has the wrong number of layers");
  if (const int64_t m = first_id_outside(batch.targets, M, V); m >= 0)
    fail("target id ", batch.targets[m], " at [", m / T, ", ", m % T, "] is outside the vocabulary (size ", V, ")");

  KVCache cache(c, B, T);
  std::copy(batch.padding_mask, batch.padding_mask + M, cache.key_valid.begin());
  // Under mixed_bfloat16 the blocks' activations are kept in bf16 (half the memory), as Keras keeps
  // them in its compute dtype.
  SavedBlocks& saved = ws.blocks;
  if (grads) saved.start(c.num_layers, model.matmul_precision == MatmulPrecision::BF16);
  std::vector<float> hidden = backbone_forward(model, batch.token_ids, B, T, 0, cache, nullptr, grads ? &saved : nullptr,
                                               grads ? &ws.final_norm_input : nullptr);

  // Loss over the rows that carry weight, a chunk at a time (the logits of a chunk only). With the
  // vocabulary split over processes each holds its columns of the logits, and the softmax's max,
  // sum and target logit are combined over the processes (kernels/cross_entropy.h).
  const std::vector<int64_t> rows = nonzero_positions(batch.sample_weight, M);
  const int64_t part = model.embeddings.rows, v0 = model.vocab_offset;  // this process' vocabulary rows
  Communicator* vocab_group = model.vocab_parallel() ? model.tensor_parallel : nullptr;
  // Rows per chunk: up to 256, with at most 32 Mi logits (128 MiB) at a time.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(256, (int64_t(1) << 25) / part));
  // Rows with zero weight get no gradient: d_hidden starts at zero, the chunks scatter into it.
  FloatBuffer& d_hidden = ws.d_hidden;
  if (grads) d_hidden = FloatBuffer(static_cast<size_t>(M * D));
  FloatBuffer &h_chunk = ws.h_chunk, &d_h_chunk = ws.d_h_chunk, &logits = ws.logits;  // overwritten chunk by chunk
  h_chunk.resize(static_cast<size_t>(chunk * D));
  d_h_chunk.resize(static_cast<size_t>(chunk * D));
  logits.resize(static_cast<size_t>(chunk * part));
  SoftmaxRows stats;
  double sums[3] = {0, 0, 0};  // Σ w·CE, Σ w·correct, Σ w
  for (size_t r0 = 0; r0 < rows.size(); r0 += size_t(chunk)) {
    const int64_t n = std::min<int64_t>(chunk, int64_t(rows.size() - r0));
    const int64_t* chunk_rows = rows.data() + r0;
    gather_rows(hidden.data(), chunk_rows, n, D, h_chunk.data());
    lm_head_local(model, h_chunk.data(), n, logits.data());
    softmax_row_max(logits.data(), n, part, v0, stats);
    if (vocab_group) {  // the first process (= lowest index) holding the overall maximum wins
      std::vector<float> mine(stats.max), all(static_cast<size_t>(2 * n * vocab_group->size()));
      mine.insert(mine.end(), stats.argmax.begin(), stats.argmax.end());
      vocab_group->all_gather(mine.data(), mine.size(), all.data());
      softmax_combine_max(all.data(), vocab_group->size(), n, stats);
    }
    softmax_row_sums(logits.data(), n, part, v0, batch.targets, chunk_rows, stats);
    if (vocab_group) vocab_group->all_reduce_sum(stats.sum_exp_and_target.data(), stats.sum_exp_and_target.size());
    softmax_cross_entropy_sums(stats, batch.targets, batch.sample_weight, chunk_rows, n, sums);
    if (!grads) continue;
    // The chunk's logits buffer becomes ∂L/∂raw_logits, then flows into the hidden states and the
    // tied embedding.
    softmax_cross_entropy_backward(logits.data(), n, part, v0, batch.targets, batch.sample_weight, chunk_rows,
                                   loss_scale, stats, c.final_logit_soft_cap);
    linear_backward_input(logits.data(), n, model.embeddings, d_h_chunk.data(), false, model.matmul_precision);
    if (vocab_group) vocab_group->all_reduce_sum(d_h_chunk.data(), size_t(n * D));  // Σ over vocabulary parts
    if (grads->embeddings) linear_backward_weight(logits.data(), h_chunk.data(), n, part, D, grads->embeddings);
    scatter_rows(d_h_chunk.data(), chunk_rows, n, D, d_hidden.data());
  }
  const LossSums totals{sums[0], sums[1], sums[2]};
  if (!grads) return totals;

  // Final norm, then the blocks in reverse, then the scaled embedding lookup.
  FloatBuffer& dx = d_hidden;
  const FloatBuffer& final_input = ws.final_norm_input;
  rmsnorm_backward(final_input.data(), model.final_norm.data(), M, D, c.layer_norm_epsilon, dx.data(), dx.data(),
                   grads->final_norm);
  for (int layer = c.num_layers - 1; layer >= 0; --layer)
    decoder_block_backward(model, model.layer_weights(layer), layer, saved.backward_set(layer), B, T, batch.padding_mask,
                           grads->layers[size_t(layer)], dx, ws);
  if (grads->embeddings)  // x = Emb[ids]·√D
    embedding_lookup_backward(dx.data(), batch.token_ids, M, D, model.vocab_offset, model.embeddings.rows,
                              float(std::sqrt(double(D))), grads->embeddings);
  return totals;
}

}  // namespace meshtune
