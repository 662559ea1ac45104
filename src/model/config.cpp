#include "model/config.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"

namespace meshtune {

const FamilyNames& GemmaConfig::names() const {
  static const FamilyNames table[] = {
      {"gemma", "Gemma", "gemma", "GemmaForCausalLM", "post_attention_layernorm", false},
      {"gemma", "Gemma", "gemma2", "Gemma2ForCausalLM", "pre_feedforward_layernorm", false},
      {"gemma3", "Gemma3", "gemma3_text", "Gemma3ForCausalLM", "pre_feedforward_layernorm", true},
  };
  check(family >= 1 && family <= 3, "Gemma family ", family, " is not 1, 2 or 3");
  return table[family - 1];
}

bool GemmaConfig::is_sliding(int layer) const {
  return use_sliding_window_attention && layer % sliding_window_pattern < sliding_window_pattern - 1;
}

float GemmaConfig::rope_base(int layer) const { return is_sliding(layer) ? rope_local_base : rope_global_base; }

float GemmaConfig::rope_scaling(int layer) const { return is_sliding(layer) ? rope_local_scaling : rope_global_scaling; }

float GemmaConfig::query_scale() const { return float(1.0 / std::sqrt(double(query_scale_dim))); }

long long GemmaConfig::num_parameters() const {
  long long D = hidden_dim, N = num_query_heads, K = num_key_value_heads, H = head_dim, F = ffw_dim;
  long long norms = 2 + (use_post_attention_norm ? 1 : 0) + (use_post_ffw_norm ? 1 : 0);
  long long per_layer = norms * D + N * D * H * 2 + K * D * H * 2 + 3 * D * F + (use_query_key_norm ? 2 * H : 0);
  return (long long)vocab_size * D + num_layers * per_layer + D;
}

// Ranges for the integers of a config: anything outside is refused before it is narrowed to int.
constexpr int64_t kMaxVocab = int64_t(1) << 24, kMaxHidden = int64_t(1) << 16, kMaxLayers = 4096,
                  kMaxHeads = 4096, kMaxHeadDim = 4096, kMaxFfw = int64_t(1) << 21, kMaxWindow = int64_t(1) << 24;

void GemmaConfig::validate(const std::string& source) const {
  auto positive = [&](long long v, const char* name) {
    check(v > 0, source, ": ", name, " must be positive, got ", v);
  };
  positive(vocab_size, "vocabulary_size");
  positive(num_layers, "num_layers");
  positive(num_query_heads, "num_query_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(hidden_dim, "hidden_dim");
  positive(ffw_dim, "intermediate_dim");
  positive(head_dim, "head_dim");
  check(head_dim % 2 == 0, source, ": head_dim must be even for RoPE, got ", head_dim);
  check(num_query_heads % num_key_value_heads == 0, source, ": num_query_heads (", num_query_heads,
        ") must be a multiple of num_key_value_heads (", num_key_value_heads, ")");
  check(std::isfinite(query_scale_dim) && query_scale_dim > 0, source, ": query scaling dimension must be positive");
  check(std::isfinite(layer_norm_epsilon) && layer_norm_epsilon > 0, source, ": layer_norm_epsilon must be positive");
  check(std::isfinite(attention_logit_soft_cap) && attention_logit_soft_cap >= 0 && std::isfinite(final_logit_soft_cap) &&
            final_logit_soft_cap >= 0,
        source, ": soft caps must be non-negative");
  check(std::isfinite(rope_local_base) && rope_local_base > 0 && std::isfinite(rope_global_base) && rope_global_base > 0 &&
            rope_local_scaling > 0 && rope_global_scaling > 0,
        source, ": RoPE bases and scaling factors must be positive");
  check(max_sequence_length > 0, source, ": the maximum sequence length must be positive");
  check(!use_sliding_window_attention || sliding_window_size > 0, source,
        ": sliding_window_size must be positive when sliding windows are used");
  check(sliding_window_pattern >= 1 && sliding_window_pattern <= kMaxLayers, source,
        ": sliding_window_pattern must be in [1, ", kMaxLayers, "], got ", sliding_window_pattern);
  check(vocab_size <= kMaxVocab && hidden_dim <= kMaxHidden && num_layers <= kMaxLayers && ffw_dim <= kMaxFfw &&
            head_dim <= kMaxHeadDim && num_query_heads <= kMaxHeads,
        source, ": implausible model dimensions");
}

// The dtype a Keras config declares: a string, a DTypePolicy object {"config": {"name": …}}, or —
// after `quantize("int8")` — a DTypePolicyMap: its default policy (null: float32) and, in
// `int8_layers`, the layer paths it maps to QuantizedDTypePolicy mode "int8" (int8.md §4).
static std::string keras_dtype(const JsonValue& c, std::set<std::string>& int8_layers) {
  auto dtype = c.find("dtype");
  if (!dtype) return "float32";
  if (dtype->is_string()) return dtype->string();
  if (!dtype->is_object()) dtype->fail("must be a string or a DTypePolicy object");
  if (dtype->string_or("class_name", "") != "DTypePolicyMap") return (*dtype)["config"]["name"].string();
  const JsonValue map = (*dtype)["config"];
  for (const auto& [layer, policy] : map["policy_map"].members()) {
    const std::string cls = policy.is_object() ? policy.string_or("class_name", "") : "";
    if (cls != "QuantizedDTypePolicy" && cls != "DTypePolicy")
      policy.fail("expected a QuantizedDTypePolicy or DTypePolicy",
                  policy.is_object() ? ", got class_name \"" + brief(cls) + "\"" : std::string(", got a non-object"));
    if (cls == "DTypePolicy") continue;  // a float layer named explicitly
    const std::string mode = policy["config"]["mode"].string();
    if (mode != "int8") policy["config"]["mode"].fail("quantization mode \"", brief(mode), "\" is not supported (only int8)");
    int8_layers.insert(layer);
  }
  auto fallback = map.find("default_policy");
  if (!fallback) return "float32";
  if (fallback->is_string()) return fallback->string();
  return (*fallback)["config"]["name"].string();
}

GemmaConfig GemmaConfig::from_keras_json(const json& j, const std::string& source) {
  const JsonValue root(j, source);
  check(root.is_object() && root.has("config") && root["config"].is_object(), source,
        ": not a Keras backbone config (no \"config\" object)");
  const std::string cls = root.string_or("class_name", "");
  check(cls == "GemmaBackbone" || cls == "Gemma3Backbone", source, ": unsupported backbone class \"", brief(cls),
        "\" (expected GemmaBackbone or Gemma3Backbone)");
  const JsonValue c = root["config"];
  GemmaConfig g;
  g.vocab_size = c["vocabulary_size"].to_int(1, kMaxVocab);
  g.num_layers = c["num_layers"].to_int(1, kMaxLayers);
  g.num_query_heads = c["num_query_heads"].to_int(1, kMaxHeads);
  g.num_key_value_heads = c["num_key_value_heads"].to_int(1, kMaxHeads);
  g.hidden_dim = c["hidden_dim"].to_int(1, kMaxHidden);
  g.head_dim = c["head_dim"].to_int(1, kMaxHeadDim);
  const int64_t intermediate = c["intermediate_dim"].integer(1, 2 * kMaxFfw);
  g.layer_norm_epsilon = float(c.number_or("layer_norm_epsilon", 1e-6));
  g.query_head_dim_normalize = c.boolean_or("query_head_dim_normalize", true);
  g.use_post_attention_norm = c.boolean_or("use_post_attention_norm", false);
  g.use_post_ffw_norm = c.boolean_or("use_post_ffw_norm", false);
  g.final_logit_soft_cap = float(c.number_or("final_logit_soft_cap", 0));
  g.attention_logit_soft_cap = float(c.number_or("attention_logit_soft_cap", 0));
  g.use_sliding_window_attention = c.boolean_or("use_sliding_window_attention", false);
  g.sliding_window_size = int(c.integer_or("sliding_window_size", 0, 0, kMaxWindow));
  g.stored_dtype = keras_dtype(c, g.int8_layers);
  if (cls == "Gemma3Backbone") {
    g.family = 3;
    g.ffw_dim = int(intermediate);
    g.use_query_key_norm = c.boolean_or("use_query_key_norm", true);
    g.rope_local_scaling = float(c.number_or("local_rope_scaling_factor", 1.0));
    g.rope_global_scaling = float(c.number_or("global_rope_scaling_factor", 1.0));
    g.rope_global_base = 1e6f;
    g.sliding_window_pattern = 6;  // fixed in KerasHub's Gemma3Backbone
    g.stop_tokens = {"<end_of_turn>"};
    g.max_sequence_length = kGemma3MaxPositions;
    check(!c.has("vision_encoder"), source, ": Gemma 3 vision presets are not supported (text only)");
  } else {
    g.family = (g.use_post_attention_norm || g.use_post_ffw_norm || g.attention_logit_soft_cap > 0) ? 2 : 1;
    check(intermediate % 2 == 0, source, ": config.intermediate_dim must be even for Gemma 1/2, got ", intermediate);
    g.ffw_dim = int(intermediate / 2);
    g.max_sequence_length = kGemma12MaxPositions;
  }
  g.query_scale_dim = g.query_head_dim_normalize ? float(g.head_dim) : float(g.hidden_dim) / float(g.num_query_heads);
  g.validate(source);
  return g;
}

GemmaConfig GemmaConfig::from_hf_json(const json& j_in, const std::string& source) {
  const JsonValue root(j_in, source);
  check(root.is_object(), source, ": not a JSON object");
  std::string type = root.string_or("model_type", "");
  JsonValue j = root;
  if (type == "gemma3" && root.has("text_config")) {
    j = root["text_config"];
    check(j.is_object(), j.where(), ": must be an object");
    type = "gemma3_text";
  }
  GemmaConfig g;
  if (type == "gemma") g.family = 1;
  else if (type == "gemma2") g.family = 2;
  else if (type == "gemma3_text") g.family = 3;
  else fail(source, ": unsupported model_type \"", brief(type), "\" (expected gemma, gemma2, gemma3_text or gemma3)");
  g.vocab_size = j["vocab_size"].to_int(1, kMaxVocab);
  g.num_layers = j["num_hidden_layers"].to_int(1, kMaxLayers);
  g.num_query_heads = j["num_attention_heads"].to_int(1, kMaxHeads);
  g.num_key_value_heads = int(j.integer_or("num_key_value_heads", g.num_query_heads, 1, kMaxHeads));
  g.hidden_dim = j["hidden_size"].to_int(1, kMaxHidden);
  g.head_dim = int(j.integer_or("head_dim", g.hidden_dim / g.num_query_heads, 1, kMaxHeadDim));
  g.ffw_dim = j["intermediate_size"].to_int(1, kMaxFfw);
  g.layer_norm_epsilon = float(j.number_or("rms_norm_eps", 1e-6));
  g.query_scale_dim = float(j.number_or("query_pre_attn_scalar", g.head_dim));
  g.query_head_dim_normalize = g.query_scale_dim == float(g.head_dim);
  g.rope_local_base = float(j.number_or("rope_theta", 10000.0));
  g.rope_global_base = g.rope_local_base;
  g.max_sequence_length = int(j.integer_or("max_position_embeddings",
                                           g.family == 3 ? kGemma3MaxPositions : kGemma12MaxPositions, 1, kMaxPositions));
  if (g.family >= 2) {
    g.use_post_attention_norm = g.use_post_ffw_norm = true;
    g.attention_logit_soft_cap = float(j.number_or("attn_logit_softcapping", 0));
    g.final_logit_soft_cap = float(j.number_or("final_logit_softcapping", 0));
    g.sliding_window_size = int(j.integer_or("sliding_window", 0, 0, kMaxWindow));
    g.use_sliding_window_attention = g.sliding_window_size > 0;
  }
  if (g.family == 3) {
    g.use_query_key_norm = true;
    g.rope_global_base = float(j.number_or("rope_theta", 1e6));
    g.rope_local_base = float(j.number_or("rope_local_base_freq", 10000.0));
    if (auto scaling = j.find("rope_scaling"); scaling && scaling->is_object())
      g.rope_global_scaling = float(scaling->number_or("factor", 1.0));
    g.sliding_window_pattern = int(j.integer_or("sliding_window_pattern", 6, 1, kMaxLayers));
    g.stop_tokens = {"<end_of_turn>"};
  }
  g.stored_dtype = j.string_or("torch_dtype", "float32");
  g.validate(source);
  return g;
}

json GemmaConfig::to_keras_json(const std::string& weights_dtype) const {
  json dtype = {{"module", "keras"}, {"class_name", "DTypePolicy"}, {"config", {{"name", weights_dtype}}},
                {"registered_name", nullptr}};
  const FamilyNames& n = names();
  json c = {{"name", std::string(n.keras_prefix) + "_backbone"},
            {"trainable", true},
            {"dtype", dtype},
            {"vocabulary_size", vocab_size},
            {"num_layers", num_layers},
            {"num_query_heads", num_query_heads},
            {"num_key_value_heads", num_key_value_heads},
            {"hidden_dim", hidden_dim},
            {"intermediate_dim", keras_intermediate_dim()},
            {"head_dim", head_dim},
            {"layer_norm_epsilon", double(layer_norm_epsilon)},
            {"dropout", 0},
            {"query_head_dim_normalize", query_head_dim_normalize},
            {"use_post_ffw_norm", use_post_ffw_norm},
            {"use_post_attention_norm", use_post_attention_norm},
            {"final_logit_soft_cap", final_logit_soft_cap > 0 ? json(double(final_logit_soft_cap)) : json()},
            {"attention_logit_soft_cap", attention_logit_soft_cap > 0 ? json(double(attention_logit_soft_cap)) : json()},
            {"sliding_window_size", sliding_window_size > 0 ? sliding_window_size : 4096},
            {"use_sliding_window_attention", use_sliding_window_attention}};
  if (family == 3) {
    c["use_query_key_norm"] = use_query_key_norm;
    c["local_rope_scaling_factor"] = double(rope_local_scaling);
    c["global_rope_scaling_factor"] = double(rope_global_scaling);
    c["vision_encoder"] = nullptr;
    c["image_size"] = 896;
    c["use_bidirectional_attention"] = false;
    c["is_embedding_model"] = false;
    c.erase("final_logit_soft_cap");
    c.erase("attention_logit_soft_cap");
    c["final_logit_soft_cap"] = nullptr;
    c["attention_logit_soft_cap"] = nullptr;
  }
  const std::string cls = std::string(n.keras_class) + "Backbone";
  const std::string module = std::string("keras_hub.src.models.") + n.keras_prefix + "." + n.keras_prefix + "_backbone";
  return {{"module", module}, {"class_name", cls}, {"config", c}, {"registered_name", "keras_hub>" + cls}};
}

json GemmaConfig::to_hf_json(const std::string& weights_dtype) const {
  json j = {{"architectures", {names().hf_architecture}},
            {"model_type", names().hf_model_type},
            {"vocab_size", vocab_size},
            {"hidden_size", hidden_dim},
            {"intermediate_size", ffw_dim},
            {"num_hidden_layers", num_layers},
            {"num_attention_heads", num_query_heads},
            {"num_key_value_heads", num_key_value_heads},
            {"head_dim", head_dim},
            {"hidden_activation", "gelu_pytorch_tanh"},
            {"rms_norm_eps", double(layer_norm_epsilon)},
            {"rope_theta", double(family == 3 ? rope_global_base : rope_local_base)},
            {"tie_word_embeddings", true},
            {"pad_token_id", 0},
            {"eos_token_id", 1},
            {"bos_token_id", 2},
            {"torch_dtype", weights_dtype},
            {"max_position_embeddings", max_sequence_length},
            // transformers declares an int; write one unless the scale really is fractional
            {"query_pre_attn_scalar", query_scale_dim == std::round(query_scale_dim) ? json(int64_t(query_scale_dim))
                                                                                      : json(double(query_scale_dim))}};
  if (family == 1) j["hidden_act"] = "gelu_pytorch_tanh";  // GemmaConfig's name; Gemma 2/3 use hidden_activation
  // The rest of what transformers' configs declare, at the values these models have.
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["use_bidirectional_attention"] = nullptr;
  if (family >= 2) {
    j["attn_logit_softcapping"] = attention_logit_soft_cap > 0 ? json(double(attention_logit_soft_cap)) : json();
    j["final_logit_softcapping"] = final_logit_soft_cap > 0 ? json(double(final_logit_soft_cap)) : json();
    j["sliding_window"] = use_sliding_window_attention ? json(sliding_window_size) : json();
    j["cache_implementation"] = "hybrid";
    json layer_types = json::array();  // the per-layer attention pattern, as transformers derives it
    for (int layer = 0; layer < num_layers; ++layer)
      layer_types.push_back(is_sliding(layer) ? "sliding_attention" : "full_attention");
    j["layer_types"] = layer_types;
  }
  if (family == 3) {
    j["rope_local_base_freq"] = double(rope_local_base);
    j["sliding_window_pattern"] = sliding_window_pattern;
    if (rope_global_scaling != 1.f) j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", double(rope_global_scaling)}};
  }
  return j;
}

}  // namespace meshtune
