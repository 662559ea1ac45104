// GemmaConfig: one plain struct describes Gemma 1, 2 and 3 (text); the family is data, not a class
// hierarchy. Parsed from a Keras backbone config.json or a Hugging Face config.json (spec §3.2, §4);
// the named variants (KerasHub presets) are in model/presets.h. Only this file and config.cpp look
// at `family`: everything else reads the fields (the attention pattern, the stop tokens, the names
// the formats use).
#pragma once
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace meshtune {

inline constexpr int kGemma12MaxPositions = 8192, kGemma3MaxPositions = 131072, kMaxPositions = 1 << 20;

// How KerasHub and Hugging Face name one family's classes, layers and tensors: one row per family.
struct FamilyNames {
  const char* keras_prefix;     // modules and layer names: "gemma" / "gemma3" (keras_hub.src.models.gemma3…)
  const char* keras_class;      // class-name stem: "Gemma" / "Gemma3" (Gemma3Backbone, Gemma3CausalLM, …)
  const char* hf_model_type;    // "gemma" / "gemma2" / "gemma3_text"
  const char* hf_architecture;  // "GemmaForCausalLM" / "Gemma2ForCausalLM" / "Gemma3ForCausalLM"
  const char* hf_pre_ffw_norm;  // the pre-FFW norm: "post_attention_layernorm" in Gemma 1, else "pre_feedforward_layernorm"
  bool keras_vision_fields;     // Gemma 3's presets carry has_vision_tokens / num_vision_tokens_per_image
};

struct GemmaConfig {
  int family = 1;  // 1, 2 or 3
  int vocab_size = 0;
  int num_layers = 0;
  int num_query_heads = 0;  // N
  int num_key_value_heads = 0;  // K
  int hidden_dim = 0;  // D
  int ffw_dim = 0;  // F: the width of one gating matrix (Keras intermediate_dim / 2 for Gemma 1/2)
  int head_dim = 0;  // H
  float layer_norm_epsilon = 1e-6f;
  // Query scaling 1/sqrt(query_scale_dim), applied after RoPE. Keras: head_dim when
  // query_head_dim_normalize, else hidden_dim / num_query_heads (spec §1.8); HF: query_pre_attn_scalar.
  float query_scale_dim = 0;
  bool query_head_dim_normalize = true;
  bool use_post_attention_norm = false;
  bool use_post_ffw_norm = false;
  bool use_query_key_norm = false;  // Gemma 3
  float attention_logit_soft_cap = 0;  // 0 = none
  float final_logit_soft_cap = 0;  // 0 = none
  bool use_sliding_window_attention = false;
  int sliding_window_size = 0;
  // The per-layer attention pattern: layers repeat in periods of this many, the last of each
  // period global (full attention, the global RoPE base), the others local (the sliding window,
  // the local base). Gemma 2: 2 (even layers local); Gemma 3: 6 (five local, one global).
  int sliding_window_pattern = 2;
  float rope_local_base = 10000.f;   // local (sliding-window) layers
  float rope_global_base = 10000.f;  // global layers: Gemma 1/2 the same as local, Gemma 3 1e6
  float rope_local_scaling = 1.f;
  float rope_global_scaling = 1.f;
  std::string stored_dtype = "float32";  // the dtype the file declared (informational)
  // Keras layer paths stored as int8 codes + scales ("token_embedding", "decoder_block_0/ffw_linear"):
  // a quantized preset's DTypePolicyMap (backend/cpu/int8.h). Empty for float checkpoints.
  std::set<std::string> int8_layers;
  // The longest sequence (prompt + generation, or a training row) the model was trained for: HF
  // max_position_embeddings, else the family's (8192 for Gemma 1/2, 131072 for Gemma 3).
  int max_sequence_length = kGemma12MaxPositions;
  // Pieces that end a generation besides the tokenizer's end of sequence (Gemma 3: <end_of_turn>,
  // as KerasHub's Gemma3CausalLM stops).
  std::vector<std::string> stop_tokens;

  const FamilyNames& names() const;

  // Layer i attends within a sliding window (see sliding_window_pattern).
  bool is_sliding(int layer) const;
  float rope_base(int layer) const;
  float rope_scaling(int layer) const;
  float query_scale() const;  // 1/sqrt(query_scale_dim), rounded to fp32
  int keras_intermediate_dim() const { return family == 3 ? ffw_dim : 2 * ffw_dim; }
  long long num_parameters() const;

  // Throws Error naming `source` if a dimension is missing, non-positive or inconsistent.
  void validate(const std::string& source) const;

  // Keras `config.json` of a GemmaBackbone / Gemma3Backbone ({"class_name":…, "config":{…}}).
  static GemmaConfig from_keras_json(const nlohmann::json& j, const std::string& source);
  // Hugging Face `config.json`, model_type gemma, gemma2, gemma3_text (or gemma3 with text_config).
  static GemmaConfig from_hf_json(const nlohmann::json& j, const std::string& source);
  // The Keras backbone config.json object for this config (what save_to_preset writes), and the HF
  // config.json. `weights_dtype` is the dtype they declare ("float32", "bfloat16"): Keras'
  // DTypePolicy name, HF's torch_dtype.
  nlohmann::json to_keras_json(const std::string& weights_dtype = "float32") const;
  nlohmann::json to_hf_json(const std::string& weights_dtype = "float32") const;
};

}  // namespace meshtune
