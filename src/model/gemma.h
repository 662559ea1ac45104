// The Gemma causal LM forward pass (spec §1), written to read like the math:
//   x = Emb[ids]·√D; for each block: x += [post_norm](attention(pre_norm(x)));
//   x += [post_norm](ffw_linear(gelu(gate(n))·up(n))) with n = pre_ffw_norm(x);
//   h = final_norm(x); logits = [soft_cap](h·Embᵀ).
// Keys and values go through a KVCache, so one function serves full-sequence scoring (`logits`),
// prefill and single-token decode.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

#include "core/buffer.h"
#include "backend/op_types.h"
#include "core/weight_matrix.h"
#include "model/config.h"
#include "model/context.h"
#include "model/variables.h"

namespace meshtune {

struct DecoderLayerWeights {
  WeightVector pre_attention_norm, post_attention_norm, pre_ffw_norm, post_ffw_norm;  // (D,)
  WeightVector query_norm, key_norm;                                                  // (H,) Gemma 3
  WeightMatrix query;             // (N·H, D)
  WeightMatrix key, value;        // (K·H, D)
  WeightMatrix attention_output;  // (D, N·H)
  WeightMatrix ffw_gating;        // (F, D) gate
  WeightMatrix ffw_gating_2;      // (F, D) up
  WeightMatrix ffw_linear;        // (D, F) down

  WeightMatrix* matrix(Slot slot);         // nullptr for norm slots
  WeightVector* vector(Slot slot);         // nullptr for matrix slots
};

// LoRA's low-rank terms of one block (training): y = x·Wᵀ + scale·(x·A)·B for each adapted matrix.
struct LayerLowRank {
  // One per matrix slot, Slot::Query … Slot::FfwLinear (the last seven of the enum, in order).
  std::array<LowRankTerm, 7> terms;
  LowRankTerm* of(Slot slot) { return slot >= Slot::Query ? &terms[size_t(int(slot) - int(Slot::Query))] : nullptr; }
};

struct GemmaModel {
  GemmaConfig config;
  WeightMatrix embeddings;  // (V, D), tied with the output projection
  std::vector<DecoderLayerWeights> layers;
  WeightVector final_norm;  // (D,)
  // Optional: builds a block's weights on demand (e.g. all-gathered from this process' blocks; for
  // inference merge_lora merges as it builds) so that only one block is whole at a time. Unset:
  // `layers` is used.
  std::function<DecoderLayerWeights(int layer)> layer_source;
  DecoderLayerWeights layer_weights(int layer) const {
    return layer_source ? layer_source(layer) : layers[size_t(layer)];
  }
  // Per block: LoRA low-rank terms added to the frozen matrices (model/lora.h attach_lora); empty = none.
  std::vector<LayerLowRank> low_rank;
  const LowRankTerm& low_rank_term(int layer, Slot slot) const;
  // Vocabulary parallelism (a tensor-parallel part, model/tensor_parallel.h): `embeddings` holds
  // rows vocab_offset … vocab_offset + embeddings.rows − 1 of the whole table; lookups and logits
  // are split by row and put together by the Context's tensor-parallel group.
  int64_t vocab_offset = 0;
  bool vocab_parallel() const { return embeddings.rows < config.vocab_size; }

  size_t weight_bytes() const;  // bytes of all weights as stored in memory (int8 scales included)
  bool has_int8() const;        // any matrix stored as int8 codes

  // The storage of variable `slot` (of decoder block `layer`): its matrix for projections and the
  // embedding (else nullptr), its vector for norm scales (else nullptr).
  WeightMatrix* matrix(Slot slot, int layer);
  WeightVector* vector(Slot slot, int layer);
  const WeightMatrix* matrix(Slot slot, int layer) const { return const_cast<GemmaModel*>(this)->matrix(slot, layer); }
  const WeightVector* vector(Slot slot, int layer) const {
    return const_cast<GemmaModel*>(this)->vector(slot, layer);
  }
};

// The model's weights in `backend`'s memory (the model itself where they are there already: the CPU
// backends compute on host weights). Blocks built on demand (layer_source) and attached LoRA terms
// are not copied: the former is an Error, the latter come from LoraTensors on the backend.
GemmaModel upload_model(const GemmaModel& model, Backend& backend);

// One projection of a decoder block: variable `slot`'s matrix W, into y.
struct Projection {
  Slot slot;
  const WeightMatrix& W;
  Floats y;
};
// y[M, W.rows] = x·Wᵀ for each projection of one input x (q, k and v; gate and up: one backend call,
// which a GPU serves reading x once), plus block `layer`'s LoRA term for the slot when the model
// carries one.
void project(const Context& ctx, const GemmaModel& model, int layer, ConstFloats x, int64_t M,
             std::initializer_list<Projection> projections);

// Per-layer keys and values for `batch` rows of up to `capacity` positions, plus which key slots
// are real tokens (key_valid = 0 marks padding keys, which no query may attend to).
struct KVCache {
  int64_t batch = 0, capacity = 0;
  // Per layer: [B, S, K, H], in the backend's memory; none in a cache of one pass (below).
  std::vector<FloatBuffer> keys, values;
  Buffer<uint8_t> key_valid;              // [B, S], in the backend's memory
  KVCache() = default;
  // Room for `batch` rows of `capacity` positions in `backend`'s memory, every key slot valid. A cache
  // of one pass (`keep_keys` false: training, scoring — a pass over whole rows that nothing continues)
  // keeps no keys or values: each block's attention reads the pass' own, which have the cache's layout
  // when the pass fills it (start 0, T = capacity). That saves a copy of every layer's keys and values
  // (7.5 GB for the 7B shape at 8 × 1024) and a launch per block.
  KVCache(const GemmaConfig& config, int64_t batch, int64_t capacity, Backend& backend, bool keep_keys = true);
  // The same, reusing the memory a larger cache had; the keys, values and key_valid are undefined
  // (a training pass writes every slot before reading it, and sets key_valid).
  void resize(const GemmaConfig& config, int64_t batch, int64_t capacity, Backend& backend, bool keep_keys = true);
  bool keeps_keys() const { return !keys.empty(); }
  // key_valid from the host: [batch, capacity] values, 0 for padding.
  void set_key_valid(Backend& backend, Span<const uint8_t> host);
};

// The attention geometry of `layer` for queries at start … start+T−1 over S cached keys; under the
// policy's bf16 precision its products take bf16 inputs (AttentionShape::bf16_products).
AttentionShape attention_shape(const GemmaConfig& config, int layer, int64_t B, int64_t T, int64_t start, int64_t S,
                               MatmulPrecision precision);

// Intermediate values the Keras fixtures record, filled when a trace is passed (copied out to the
// host: tests and the training loss read them there).
struct ForwardTrace {
  std::vector<float> embedding_lookup, embedding_scaled;  // [B·T, D]
  std::vector<std::vector<float>> block_outputs;          // per block: [B·T, D]
};

// The intermediate values of one decoder block that backward needs (kept when training). Not kept:
// ffw_linear's input gelu(gate)·up, F wide (backward recomputes it when it needs it), which lives in
// BlockScratch, shared by the blocks, and the branches after their post-norms (formed inside the joins).
struct BlockActivations {
  FloatBuffer input;          // x entering the block [M, D]
  FloatBuffer attn_normed;    // pre_attention_norm(x) [M, D]
  FloatBuffer q_raw, k_raw;   // projections before the Gemma 3 q/k norm [M, N·H], [M, K·H]
  FloatBuffer q, k, v;        // after norm + RoPE (+ query scale for q) [M, N·H], [M, K·H]
  FloatBuffer attended;       // attention output per head [M, N·H]
  FloatBuffer attn_projected; // attention_output(attended), before post-norm [M, D]
  FloatBuffer mid;            // x after the attention residual [M, D]
  FloatBuffer ffw_normed;     // pre_ffw_norm(mid) [M, D]
  FloatBuffer gate, up;       // gate/up projections before GeGLU [M, F] (not kept where gate_up_bf16 is)
  FloatBuffer ffw_projected;  // ffw_linear(gelu(gate)·up), before post-norm [M, D]
  // Training under the bf16 policies where nothing differentiates the feed-forward's matrices (LoRA
  // on attention, the tutorial's): gate and up as backward keeps them, in bf16 [2, M, F] — gate,
  // then up —, written by GeGLU itself (Backend::geglu_to_bf16); SavedBlocks' buffer of the layer.
  // Null otherwise: gate and up are kept with the other activations.
  Bf16Buffer* gate_up_bf16 = nullptr;
};
struct BlockScratch {
  FloatBuffer activated;        // gelu(gate)·up [M, F]
  Bf16Buffer activated_bf16;    // the same in bf16, the down projection's input (with gate_up_bf16)
  FloatBuffer residual;   // a branch's output after its post-norm [M, D], for a traced pass' separate joins
};

// What training keeps of every block for the backward pass. In fp32, one BlockActivations per
// layer; in bf16 (the mixed_bfloat16 policy, as Keras keeps activations in its bf16 compute dtype)
// each block's activations are rounded to bf16 once its forward is done — half the memory — and
// widened back into one fp32 working set for its backward.
class SavedBlocks {
 public:
  // Before a forward pass of `layers` blocks; reuses the buffers of a previous step. With
  // `feed_forward_bf16` (bf16 only) the blocks keep gate and up in bf16 themselves (gate_up_bf16).
  void start(Backend& backend, int layers, bool bf16, bool feed_forward_bf16 = false);
  bool bf16() const { return bf16_; }
  // Where block `layer`'s forward writes, then keep(layer) once it is done.
  BlockActivations& forward_set(int layer);
  void keep(int layer);
  // Block `layer`'s activations for its backward (bf16: widened into the working set, which the
  // next call overwrites).
  const BlockActivations& backward_set(int layer);

  // Bytes held: every layer's activations (bf16: their bf16 copies and the fp32 working set).
  size_t bytes() const;

  static constexpr size_t kBuffers = 14;  // the FloatBuffers of a BlockActivations

 private:
  // The working set pointed at block `layer`'s gate_up_bf16 (or at none).
  BlockActivations& working_set(int layer);

  Backend* backend_ = nullptr;
  bool bf16_ = false, feed_forward_bf16_ = false;
  std::vector<Bf16Buffer> gate_up_;                   // feed_forward_bf16: each layer's gate_up_bf16
  std::vector<BlockActivations> fp32_;                // one per layer; with bf16, the one working set
  std::vector<Bf16Buffer> packed_;                    // bf16: each layer's buffers, one after the other
  std::vector<std::array<size_t, kBuffers>> sizes_;   // bf16: each layer's buffer sizes
};

// The buffers a forward pass computes in, kept from pass to pass (decode steps, training steps) so
// that a pass of a shape seen before allocates nothing.
struct ForwardWorkspace {
  Buffer<int32_t> ids;       // the pass' token ids [M], on the backend
  Buffer<int64_t> positions; // their positions [M]
  FloatBuffer x;             // the residual stream [M, D]
  FloatBuffer hidden;        // after the final norm [M, D]: what backbone_forward returns
  BlockActivations unsaved;  // a block's values when they are not kept for backward
  BlockScratch scratch;
};

// Runs the backbone on tokens [B, T] (host ids) placed at positions start .. start+T−1 of every
// row, writing their keys/values into `cache` (whose key_valid the caller sets; a cache of one pass
// must be filled by this one: start 0, T its capacity). Returns the hidden
// states after the final norm, [B·T, D], in the backend's memory (ws.hidden). Throws Error for a
// token id outside the vocabulary. With `saved` (started by the caller), every block's activations
// are kept for backward, and `final_norm_input` (if given) receives the residual stream entering
// the final norm [B·T, D].
const FloatBuffer& backbone_forward(const Context& ctx, const GemmaModel& model, const int32_t* tokens, int64_t B,
                                    int64_t T, int64_t start, KVCache& cache, ForwardWorkspace& ws,
                                    ForwardTrace* trace = nullptr, SavedBlocks* saved = nullptr,
                                    FloatBuffer* final_norm_input = nullptr);
// The same over ids and positions [M] already in the backend's memory (greedy decoding feeds each
// step the tokens the last one chose there); ws.ids and ws.positions are not touched.
const FloatBuffer& backbone_forward(const Context& ctx, const GemmaModel& model, Span<const int32_t> ids,
                                    Span<const int64_t> positions, int64_t B, int64_t T, int64_t start,
                                    KVCache& cache, ForwardWorkspace& ws, ForwardTrace* trace = nullptr,
                                    SavedBlocks* saved = nullptr, FloatBuffer* final_norm_input = nullptr);
// The same with a workspace of its own (one pass: scoring, tests).
FloatBuffer backbone_forward(const Context& ctx, const GemmaModel& model, const int32_t* tokens, int64_t B, int64_t T,
                             int64_t start, KVCache& cache, ForwardTrace* trace = nullptr);

// logits[M, V] = soft_cap(hidden[M, D] · Embᵀ) (all-gathered over the vocabulary when it is split).
void lm_head(const Context& ctx, const GemmaModel& model, ConstFloats hidden, int64_t M, Floats logits);
// This process' columns of the logits: [M, embeddings.rows] for vocabulary rows vocab_offset ….
void lm_head_local(const Context& ctx, const GemmaModel& model, ConstFloats hidden, int64_t M, Floats logits);

}  // namespace meshtune
