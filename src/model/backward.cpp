#include "model/backward.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/activation.h"
#include "kernels/linear.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"

namespace meshtune {

// Backward of project(): dx (+)= dy·W plus the LoRA term's share; ∂W += dyᵀ·x when `grad_w` (full
// fine-tuning); the LoRA term adds its ∂A and ∂B (W itself is never differentiated under LoRA).
static void project_backward(const GemmaModel& model, int layer, Slot slot, const float* x, const float* dy, int64_t M,
                             const WeightMatrix& W, float* dx, bool accumulate, float* grad_w) {
  linear_backward_input(dy, M, W, dx, accumulate);
  if (grad_w) linear_backward_weight(dy, x, M, W.rows, W.cols, grad_w);
  low_rank_backward(x, dy, M, model.low_rank_term(layer, slot), dx);
}

// Backward of one decoder block (mirror of decoder_block in gemma.cpp). On entry dx holds
// ∂L/∂(block output) [M, D]; on exit ∂L/∂(block input). Weight gradients are added into g.
static void decoder_block_backward(const GemmaModel& model, const DecoderLayerWeights& w, int layer,
                                   const BlockActivations& a, int64_t B, int64_t T, const uint8_t* key_valid,
                                   const LayerGradients& g, std::vector<float>& dx, TrainingWorkspace& ws) {
  const GemmaConfig& c = model.config;
  const int64_t M = B * T, D = c.hidden_dim, N = c.num_query_heads, K = c.num_key_value_heads, H = c.head_dim,
                F = c.ffw_dim;
  const float eps = c.layer_norm_epsilon;
  // Workspace buffers: each is overwritten by the kernel that produces it (none accumulates into
  // stale values), so they are sized but not cleared.
  auto sized = [](std::vector<float>& v, int64_t n) -> std::vector<float>& {
    v.resize(static_cast<size_t>(n));
    return v;
  };

  // --- feed-forward branch: out = mid + post_ffw_norm(ffw_linear(gelu(gate)·up)) ---
  std::vector<float>& d_branch = ws.d_branch;
  d_branch.assign(dx.begin(), dx.end());
  if (c.use_post_ffw_norm)
    rmsnorm_backward(a.ffw_projected.data(), w.post_ffw_norm.data(), M, D, eps, d_branch.data(), d_branch.data(),
                     g.post_ffw_norm);
  std::vector<float>&d_activated = sized(ws.d_activated, M * F), &d_gate = sized(ws.d_gate, M * F),
                     &d_up = sized(ws.d_up, M * F);
  project_backward(model, layer, Slot::FfwLinear, a.activated.data(), d_branch.data(), M, w.ffw_linear,
                   d_activated.data(), false, g.ffw_linear);
  geglu_backward(a.gate.data(), a.up.data(), d_activated.data(), M * F, d_gate.data(), d_up.data());
  std::vector<float>& d_normed = sized(ws.d_normed, M * D);
  project_backward(model, layer, Slot::FfwGating, a.ffw_normed.data(), d_gate.data(), M, w.ffw_gating,
                   d_normed.data(), false, g.ffw_gating);
  project_backward(model, layer, Slot::FfwGating2, a.ffw_normed.data(), d_up.data(), M, w.ffw_gating_2,
                   d_normed.data(), /*accumulate=*/true, g.ffw_gating_2);
  if (model.tensor_parallel) model.tensor_parallel->all_reduce_sum(d_normed.data(), size_t(M * D));  // Σ over width
  rmsnorm_backward(a.mid.data(), w.pre_ffw_norm.data(), M, D, eps, d_normed.data(), d_normed.data(), g.pre_ffw_norm);
  for (int64_t i = 0; i < M * D; ++i) dx[i] += d_normed[i];  // now ∂L/∂mid

  // --- attention branch: mid = input + post_attention_norm(attention_output(attention(q, k, v))) ---
  d_branch.assign(dx.begin(), dx.end());
  if (c.use_post_attention_norm)
    rmsnorm_backward(a.attn_projected.data(), w.post_attention_norm.data(), M, D, eps, d_branch.data(),
                     d_branch.data(), g.post_attention_norm);
  std::vector<float>& d_attended = sized(ws.d_attended, M * N * H);
  project_backward(model, layer, Slot::AttentionOutput, a.attended.data(), d_branch.data(), M, w.attention_output,
                   d_attended.data(), false, g.attention_output);
  std::vector<float>&dq = sized(ws.dq, M * N * H), &dk = sized(ws.dk, M * K * H), &dv = sized(ws.dv, M * K * H);
  attention_backward(a.q.data(), a.k.data(), a.v.data(), key_valid, attention_shape(c, layer, B, T, 0, T),
                     d_attended.data(), dq.data(), dk.data(), dv.data());
  const float scale = c.query_scale();
  for (float& value : dq) value *= scale;
  std::vector<int64_t> positions(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) positions[m] = m % T;
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
  for (int64_t i = 0; i < M * D; ++i) dx[i] += d_normed[i];  // now ∂L/∂input
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
  for (int64_t m = 0; m < M; ++m)
    check(batch.targets[m] >= 0 && batch.targets[m] < V, "target id ", batch.targets[m], " at [", m / T, ", ", m % T,
          "] is outside the vocabulary (size ", V, ")");

  KVCache cache(c, B, T);
  std::copy(batch.padding_mask, batch.padding_mask + M, cache.key_valid.begin());
  ForwardTrace trace;
  std::vector<BlockActivations>& saved = ws.blocks;
  std::vector<float> hidden = backbone_forward(model, batch.token_ids, B, T, 0, cache, &trace, grads ? &saved : nullptr);

  // Loss over the rows that carry weight, a chunk at a time (the logits of a chunk only). With the
  // vocabulary split over processes each holds its columns of the logits, and the softmax's max,
  // sum and target logit are combined over the processes.
  std::vector<int64_t> rows;
  for (int64_t m = 0; m < M; ++m)
    if (batch.sample_weight[m] != 0.f) rows.push_back(m);
  const int64_t part = model.embeddings.rows, v0 = model.vocab_offset;  // this process' vocabulary rows
  Communicator* vocab_group = model.vocab_parallel() ? model.tensor_parallel : nullptr;
  // Rows per chunk: up to 256, with at most 64 Mi logits (256 MiB) at a time.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(256, (int64_t(1) << 26) / part));
  std::vector<float> d_hidden(static_cast<size_t>(grads ? M * D : 0), 0.f);
  std::vector<float> h_chunk(static_cast<size_t>(chunk * D)), d_h_chunk(static_cast<size_t>(chunk * D));
  std::vector<float>& logits = ws.logits;  // overwritten chunk by chunk
  logits.resize(static_cast<size_t>(chunk * part));
  const float cap = c.final_logit_soft_cap;
  LossSums sums;
  for (size_t r0 = 0; r0 < rows.size(); r0 += size_t(chunk)) {
    const int64_t n = std::min<int64_t>(chunk, int64_t(rows.size() - r0));
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(hidden.begin() + rows[r0 + i] * D, D, h_chunk.begin() + i * D);
    lm_head_local(model, h_chunk.data(), n, logits.data());
    // Each row's largest logit and its index (ties: the first index, as Keras' argmax).
    std::vector<float> row_max(static_cast<size_t>(n)), row_best(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float* z = logits.data() + i * part;
      const int64_t best = std::max_element(z, z + part) - z;
      row_max[size_t(i)] = z[best];
      row_best[size_t(i)] = float(v0 + best);  // exact: vocabularies are below 2^24
    }
    if (vocab_group) {  // the first process (= lowest index) holding the overall maximum wins
      const int p = vocab_group->size();
      std::vector<float> mine(row_max), all(static_cast<size_t>(2 * n * p));
      mine.insert(mine.end(), row_best.begin(), row_best.end());
      vocab_group->all_gather(mine.data(), mine.size(), all.data());
      for (int64_t i = 0; i < n; ++i)
        for (int r = 0; r < p; ++r) {
          const float value = all[size_t((2 * r) * n + i)], index = all[size_t((2 * r + 1) * n + i)];
          if (r == 0 || value > row_max[size_t(i)]) row_max[size_t(i)] = value, row_best[size_t(i)] = index;
        }
    }
    // Σ exp(z − max) over this process' columns, and the target's logit if it is one of them.
    std::vector<double> row_sums(static_cast<size_t>(2 * n), 0.0);  // [sum_exp…, z_y…]
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float* z = logits.data() + i * part;
      const int64_t y = batch.targets[rows[r0 + size_t(i)]] - v0;
      double sum_exp = 0;
      for (int64_t v = 0; v < part; ++v) sum_exp += std::exp(double(z[v] - row_max[size_t(i)]));
      row_sums[size_t(i)] = sum_exp;
      row_sums[size_t(n + i)] = y >= 0 && y < part ? double(z[y]) : 0.0;
    }
    if (vocab_group) vocab_group->all_reduce_sum(row_sums.data(), row_sums.size());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t m = rows[r0 + size_t(i)];
      const double w = batch.sample_weight[m];
      const double log_sum = std::log(row_sums[size_t(i)]);
      sums.weighted_ce += w * (log_sum + double(row_max[size_t(i)]) - double(float(row_sums[size_t(n + i)])));
      sums.weighted_correct += w * (int64_t(row_best[size_t(i)]) == batch.targets[m] ? 1.0 : 0.0);
      sums.weight += batch.sample_weight[m];
    }
    if (!grads) continue;
    // ∂(scale·w·CE)/∂z = scale·w·(softmax − onehot), through the final soft-cap if any; the chunk's
    // logits buffer then holds ∂L/∂raw_logits. Rows are independent: they run in parallel.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t m = rows[r0 + size_t(i)];
      float* z = logits.data() + i * part;
      const int64_t y = batch.targets[m] - v0;
      const float factor = float(loss_scale * batch.sample_weight[m]), inv_sum = float(1.0 / row_sums[size_t(i)]);
      const float max_z = row_max[size_t(i)];
      for (int64_t v = 0; v < part; ++v) {
        float dz = std::exp(z[v] - max_z) * inv_sum * factor;
        if (v == y) dz -= factor;
        if (cap > 0) dz *= 1.f - (z[v] / cap) * (z[v] / cap);
        z[v] = dz;
      }
    }
    linear_backward_input(logits.data(), n, model.embeddings, d_h_chunk.data());
    if (vocab_group) vocab_group->all_reduce_sum(d_h_chunk.data(), size_t(n * D));  // Σ over vocabulary parts
    if (grads->embeddings) linear_backward_weight(logits.data(), h_chunk.data(), n, part, D, grads->embeddings);
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(d_h_chunk.begin() + i * D, D, d_hidden.begin() + rows[r0 + i] * D);
  }
  if (!grads) return sums;

  // Final norm, then the blocks in reverse, then the scaled embedding lookup.
  std::vector<float>& dx = d_hidden;
  const std::vector<float>& final_input = trace.block_outputs.back();
  rmsnorm_backward(final_input.data(), model.final_norm.data(), M, D, c.layer_norm_epsilon, dx.data(), dx.data(),
                   grads->final_norm);
  for (int layer = c.num_layers - 1; layer >= 0; --layer)
    decoder_block_backward(model, model.layer_weights(layer), layer, saved[size_t(layer)], B, T, batch.padding_mask,
                           grads->layers[size_t(layer)], dx, ws);
  if (grads->embeddings) {
    const float embedding_scale = float(std::sqrt(double(D)));
    for (int64_t m = 0; m < M; ++m) {
      const int64_t row_index = int64_t(batch.token_ids[m]) - model.vocab_offset;
      if (row_index < 0 || row_index >= model.embeddings.rows) continue;  // another process' row
      float* row = grads->embeddings + row_index * D;
      for (int64_t i = 0; i < D; ++i) row[i] += dx[m * D + i] * embedding_scale;
    }
  }
  return sums;
}

}  // namespace meshtune
