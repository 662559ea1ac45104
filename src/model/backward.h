// Training: the causal-LM loss and its gradient (spec §8), written as explicit per-layer backward
// passes that mirror gemma.cpp's forward. The loss is Keras' SparseCategoricalCrossentropy
// (from logits, sample weights, reduction sum_over_batch_size): Σ w·CE / (B·T). Logits are formed
// a chunk of rows at a time and rows with zero weight are skipped, so [B·T, V] never exists.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "model/gemma.h"

namespace meshtune {

// One training batch: x = token_ids, y = targets, w = sample_weight, key padding mask.
struct TokenBatch {
  int64_t batch = 0, length = 0;  // B, T
  const int32_t* token_ids = nullptr;    // [B, T]
  const uint8_t* padding_mask = nullptr; // [B, T]
  const int32_t* targets = nullptr;      // [B, T]
  const float* sample_weight = nullptr;  // [B, T]
};

// Where backward adds weight gradients (+=, fp32, our [out, in] layouts, in the backend's memory
// — host memory today: the Trainer's); null = frozen.
struct LayerGradients {
  float *query = nullptr, *key = nullptr, *value = nullptr, *attention_output = nullptr;
  float *ffw_gating = nullptr, *ffw_gating_2 = nullptr, *ffw_linear = nullptr;
  float *pre_attention_norm = nullptr, *post_attention_norm = nullptr, *pre_ffw_norm = nullptr,
        *post_ffw_norm = nullptr, *query_norm = nullptr, *key_norm = nullptr;
};
struct ModelGradients {
  float* embeddings = nullptr;  // [V, D]: the lookup and the tied output projection
  std::vector<LayerGradients> layers;
  float* final_norm = nullptr;
  float*& of(Slot slot, int layer);  // the pointer for variable `slot` of block `layer`
};

// Σ over the batch of w·CE, w·[argmax = y] and w (Keras' metric states before dividing).
struct LossSums {
  double weighted_ce = 0, weighted_correct = 0, weight = 0;
};

// Buffers one training step needs — every block's activations and backward's temporaries — kept
// from step to step so that steps of the same shape allocate (and page-fault, and zero) nothing.
struct TrainingWorkspace {
  KVCache cache;             // the batch's keys and values (capacity T)
  ForwardWorkspace forward;  // the residual stream and the hidden states
  SavedBlocks blocks;
  FloatBuffer d_branch, activated, d_activated, d_gate, d_up, d_normed, d_attended, dq, dk, dv;
  Bf16Buffer d_gate_up_bf16;  // ∂gate, then ∂up, where the blocks keep gate and up in bf16 [2, M, F]
  FloatBuffer d_hidden;               // ∂L/∂ the final hidden states, then the residual stream's gradient [M, D]
  FloatBuffer h_chunk, d_h_chunk;     // one chunk of rows of the hidden states and of their gradient
  FloatBuffer logits;                 // one chunk of rows' logits (up to 128 MiB)
  FloatBuffer final_norm_input;       // the residual stream entering the final norm [M, D]
  // The loss: the weighted rows with their targets and weights (uploaded once per pass), the
  // chunk's softmax statistics, and Σ w·CE, Σ w·correct, Σ w (downloaded once per pass).
  Buffer<int64_t> loss_rows;
  Buffer<int32_t> loss_targets;
  FloatBuffer loss_weights;
  SoftmaxRows loss_stats;
  Buffer<double> loss_sums;
};

// Rows of logits the loss computes at a time over `vocab_rows` columns: up to 256, with at most
// 32 Mi logits (128 MiB) at a time.
inline int64_t loss_chunk_rows(int64_t vocab_rows) {
  return std::max<int64_t>(1, std::min<int64_t>(256, (int64_t(1) << 25) / std::max<int64_t>(1, vocab_rows)));
}

// Forward (and, with `grads`, backward) of the loss scaled by `loss_scale` — Keras uses
// 1/(B·T). Gradients are accumulated into `grads`. Returns the unscaled sums. `workspace`
// (optional) keeps the buffers for the next call.
LossSums forward_backward(const Context& ctx, const GemmaModel& model, const TokenBatch& batch, double loss_scale,
                          const ModelGradients* grads, TrainingWorkspace* workspace = nullptr);

}  // namespace meshtune
