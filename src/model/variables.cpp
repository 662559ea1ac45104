#include "model/variables.h"

#include <algorithm>
#include <array>
#include <optional>

#include "core/error.h"

namespace meshtune {

std::vector<int> our_dimensions(VarKind kind) {
  switch (kind) {
    case VarKind::Embedding: return {1, 2};     // (V, D) → (1, V, D)
    case VarKind::Norm: return {2};             // (D,) → (1, 1, D)
    case VarKind::HeadsIn: return {0, 2, 1};    // (n, d, h) → (n, h, d)
    case VarKind::HeadsOut: return {1, 2, 0};   // (n, h, d) → (d, n, h)
    case VarKind::Dense: return {2, 1};         // (in, out) → (1, out, in)
  }
  return {};
}

std::vector<VariableSpec> gemma_variables(const GemmaConfig& c) {
  const int64_t V = c.vocab_size, D = c.hidden_dim, N = c.num_query_heads, K = c.num_key_value_heads,
                H = c.head_dim, F = c.ffw_dim;
  std::vector<VariableSpec> vars;
  vars.push_back({"token_embedding/embeddings", "layers/reversible_embedding/vars/0", "model.embed_tokens.weight",
                  {V, D}, {V, D}, VarKind::Embedding, Slot::Embeddings, -1});
  const std::string block_class = std::string(c.names().keras_prefix) + "_decoder_block";
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string kp = "decoder_block_" + std::to_string(i) + "/";
    const std::string hp = "layers/" + block_class + (i ? "_" + std::to_string(i) : "") + "/";
    const std::string fp = "model.layers." + std::to_string(i) + ".";
    auto add = [&](const std::string& keras, const std::string& h5, const std::string& hf, Shape ks, Shape hs,
                   VarKind kind, Slot slot) {
      vars.push_back({kp + keras, hp + h5 + "/vars/0", fp + hf, ks, hs, kind, slot, i});
    };
    add("pre_attention_norm/scale", "pre_attention_norm", "input_layernorm.weight", {D}, {D}, VarKind::Norm,
        Slot::PreAttentionNorm);
    if (c.use_post_attention_norm)
      add("post_attention_norm/scale", "post_attention_norm", "post_attention_layernorm.weight", {D}, {D},
          VarKind::Norm, Slot::PostAttentionNorm);
    add("attention/query/kernel", "attention/query_dense", "self_attn.q_proj.weight", {N, D, H}, {N * H, D},
        VarKind::HeadsIn, Slot::Query);
    add("attention/key/kernel", "attention/key_dense", "self_attn.k_proj.weight", {K, D, H}, {K * H, D},
        VarKind::HeadsIn, Slot::Key);
    add("attention/value/kernel", "attention/value_dense", "self_attn.v_proj.weight", {K, D, H}, {K * H, D},
        VarKind::HeadsIn, Slot::Value);
    if (c.use_query_key_norm) {
      add("attention/query_norm/scale", "attention/query_norm", "self_attn.q_norm.weight", {H}, {H}, VarKind::Norm,
          Slot::QueryNorm);
      add("attention/key_norm/scale", "attention/key_norm", "self_attn.k_norm.weight", {H}, {H}, VarKind::Norm,
          Slot::KeyNorm);
    }
    add("attention/attention_output/kernel", "attention/output_dense", "self_attn.o_proj.weight", {N, H, D},
        {D, N * H}, VarKind::HeadsOut, Slot::AttentionOutput);
    // The norm-naming trap (spec §4): HF Gemma 1 calls the pre-FFW norm post_attention_layernorm.
    add("pre_ffw_norm/scale", "pre_ffw_norm",
        std::string(c.names().hf_pre_ffw_norm) + ".weight", {D}, {D},
        VarKind::Norm, Slot::PreFfwNorm);
    if (c.use_post_ffw_norm)
      add("post_ffw_norm/scale", "post_ffw_norm", "post_feedforward_layernorm.weight", {D}, {D}, VarKind::Norm,
          Slot::PostFfwNorm);
    add("ffw_gating/kernel", "gating_ffw", "mlp.gate_proj.weight", {D, F}, {F, D}, VarKind::Dense, Slot::FfwGating);
    add("ffw_gating_2/kernel", "gating_ffw_2", "mlp.up_proj.weight", {D, F}, {F, D}, VarKind::Dense,
        Slot::FfwGating2);
    add("ffw_linear/kernel", "ffw_linear", "mlp.down_proj.weight", {F, D}, {D, F}, VarKind::Dense, Slot::FfwLinear);
  }
  vars.push_back({"final_normalization/scale", "layers/rms_normalization/vars/0", "model.norm.weight", {D}, {D},
                  VarKind::Norm, Slot::FinalNorm, -1});
  return vars;
}

std::string keras_layer(const VariableSpec& spec) { return spec.keras_path.substr(0, spec.keras_path.rfind('/')); }

std::string keras_int8_scale_path(const VariableSpec& spec) {
  std::string path = spec.h5_path;  // ".../vars/0"
  path.back() = '1';
  return path;
}

Shape keras_int8_scale_shape(const VariableSpec& spec) {
  const Shape& k = spec.keras_shape;
  switch (spec.kind) {
    case VarKind::Embedding: return {k[0]};
    case VarKind::HeadsIn: return {1, 1, k[0], k[2]};
    case VarKind::HeadsOut: return {1, 1, k[2]};
    case VarKind::Dense: return {1, 1, k[1]};
    case VarKind::Norm: break;
  }
  fail(spec.keras_path, ": a norm scale has no int8 form");
}

// dst[a][b][c] (row-major, shape `od`) = src[a·s0 + b·s1 + c·s2], in tiles of kTile³ elements so
// that reads and writes both stay within a few cache lines whatever the permutation (walking the
// output in order reads the source a cache line per element: minutes for a 7B model's matrices).
// A Keras kernel of `kind` as a 3-D view, the permutation to ours, and our [rows, cols] shape; none
// for the kinds whose layouts agree (embedding, norm scales).
struct KerasToOurs {
  std::array<int64_t, 3> dims;
  std::array<int, 3> perm;
  int64_t rows, cols;
};
static std::optional<KerasToOurs> keras_to_ours_permutation(const Shape& k, VarKind kind) {
  switch (kind) {
    case VarKind::Embedding:
    case VarKind::Norm: return std::nullopt;
    case VarKind::HeadsIn:  // (n, d, h) -> (n, h, d) = (n·H, D)
      return KerasToOurs{{k[0], k[1], k[2]}, {0, 2, 1}, k[0] * k[2], k[1]};
    case VarKind::HeadsOut:  // (n, h, d) -> (d, n, h) = (D, N·H)
      return KerasToOurs{{k[0], k[1], k[2]}, {2, 0, 1}, k[2], k[0] * k[1]};
    case VarKind::Dense:  // (in, out) -> (out, in)
      return KerasToOurs{{1, k[0], k[1]}, {0, 2, 1}, k[1], k[0]};
  }
  return std::nullopt;
}

HostTensor keras_to_ours(const HostTensor& k, VarKind kind) {
  const std::optional<KerasToOurs> p = keras_to_ours_permutation(k.shape, kind);
  return p ? permute3(k, p->dims, p->perm, {p->rows, p->cols}) : k;
}

std::optional<WeightMatrix> keras_kernel_to_int8(const HostTensor& k, VarKind kind) {
  const std::optional<KerasToOurs> p = keras_to_ours_permutation(k.shape, kind);
  if (!p || (k.dtype != DType::F32 && k.dtype != DType::BF16)) return std::nullopt;
  return quantize_permuted_int8(k, p->dims, p->perm, p->rows, p->cols);
}

HostTensor ours_to_keras(const HostTensor& t, VarKind kind, const Shape& ks) {
  switch (kind) {
    case VarKind::Embedding:
    case VarKind::Norm: return t;
    case VarKind::HeadsIn:  // (n, h, d) -> (n, d, h)
      return permute3(t, {ks[0], ks[2], ks[1]}, {0, 2, 1}, ks);
    case VarKind::HeadsOut:  // (d, n, h) -> (n, h, d)
      return permute3(t, {ks[2], ks[0], ks[1]}, {1, 2, 0}, ks);
    case VarKind::Dense:  // (out, in) -> (in, out)
      return permute3(t, {1, ks[1], ks[0]}, {0, 2, 1}, ks);
  }
  return t;
}

}  // namespace meshtune
