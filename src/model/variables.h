// The variables of a Gemma backbone, in Keras `backbone.weights` order, with every name they go by:
// the Keras variable path, the dataset path inside `model.weights.h5`, and the Hugging Face
// tensor name (spec §2, §3.3, §4). Loading, saving and `info` all walk this one table.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "core/weight_matrix.h"
#include "model/config.h"

namespace meshtune {

// How a variable's Keras layout maps onto our [out, in] matrices (= HF layout).
enum class VarKind {
  Embedding,     // (V, D) in both
  Norm,          // (D,) or (H,) in both
  HeadsIn,       // Keras (heads, D, H) -> ours (heads·H, D): query, key, value
  HeadsOut,      // Keras (N, H, D)     -> ours (D, N·H):     attention_output
  Dense,         // Keras (in, out)     -> ours (out, in):    ffw_gating, ffw_gating_2, ffw_linear
};

enum class Slot {
  Embeddings, FinalNorm,
  PreAttentionNorm, PostAttentionNorm, PreFfwNorm, PostFfwNorm, QueryNorm, KeyNorm,
  Query, Key, Value, AttentionOutput, FfwGating, FfwGating2, FfwLinear,  // the block's matrices: keep them last
};

struct VariableSpec {
  std::string keras_path;  // "decoder_block_0/attention/query/kernel"
  std::string h5_path;     // "layers/gemma_decoder_block/attention/query_dense/vars/0"
  std::string hf_name;     // "model.layers.0.self_attn.q_proj.weight"
  Shape keras_shape;       // (N, D, H)
  Shape hf_shape;          // (N·H, D) — also our in-memory layout
  VarKind kind;
  Slot slot;
  int layer = -1;          // decoder block index, -1 for embeddings / final norm
};

// Our 3-D dimension ([d0, d1, d2], row-major) holding each Keras dimension of a variable of `kind`:
// how distribution/sharding.h places a variable split by its Keras PartitionSpec.
std::vector<int> our_dimensions(VarKind kind);

std::vector<VariableSpec> gemma_variables(const GemmaConfig& config);

// The Keras layer a variable belongs to: its path without the variable's name
// ("decoder_block_0/attention/query", "token_embedding").
std::string keras_layer(const VariableSpec& spec);
// A matrix variable of an int8 layer (Keras `quantize("int8")`, backend/cpu/int8.h): the h5 dataset of
// its scale (vars/1 beside the kernel's vars/0) and the shape Keras stores it in — broadcast
// against the layer's output: (1, 1, n, h) for query/key/value, (1, 1, out) for the other
// projections, (V,) for the embedding.
std::string keras_int8_scale_path(const VariableSpec& spec);
Shape keras_int8_scale_shape(const VariableSpec& spec);

// Converts a tensor between Keras layout and ours (= HF), any element size. `to_ours` picks the
// direction. Returns a new owning tensor of the same dtype.
HostTensor keras_to_ours(const HostTensor& keras, VarKind kind);
HostTensor ours_to_keras(const HostTensor& ours, VarKind kind, const Shape& keras_shape);
// A Keras F32/BF16 kernel of a permuted kind in our layout, quantized to int8 (quantize_matrix_int8
// of keras_to_ours, bit for bit) without the permuted copy; none for other dtypes and kinds.
std::optional<WeightMatrix> keras_kernel_to_int8(const HostTensor& keras, VarKind kind);

}  // namespace meshtune
