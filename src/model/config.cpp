#include "model/config.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace meshtune {

using json = nlohmann::json;

bool GemmaConfig::is_sliding(int layer) const {
  if (!use_sliding_window_attention) return false;
  if (family == 3) return layer % 6 < 5;
  return layer % 2 == 0;
}

float GemmaConfig::rope_base(int layer) const {
  return (family == 3 && !is_sliding(layer)) ? rope_global_base : rope_local_base;
}

float GemmaConfig::rope_scaling(int layer) const {
  return (family == 3 && !is_sliding(layer)) ? rope_global_scaling : rope_local_scaling;
}

float GemmaConfig::query_scale() const { return float(1.0 / std::sqrt(double(query_scale_dim))); }

long long GemmaConfig::num_parameters() const {
  long long D = hidden_dim, N = num_query_heads, K = num_key_value_heads, H = head_dim, F = ffw_dim;
  long long norms = 2 + (use_post_attention_norm ? 1 : 0) + (use_post_ffw_norm ? 1 : 0);
  long long per_layer = norms * D + N * D * H * 2 + K * D * H * 2 + 3 * D * F + (use_query_key_norm ? 2 * H : 0);
  return (long long)vocab_size * D + num_layers * per_layer + D;
}

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
  check(query_scale_dim > 0, source, ": query scaling dimension must be positive");
  check(!use_sliding_window_attention || sliding_window_size > 0, source,
        ": sliding_window_size must be positive when sliding windows are used");
  check(vocab_size <= (1 << 24) && hidden_dim <= (1 << 16) && num_layers <= 4096 && ffw_dim <= (1 << 20) &&
            head_dim <= 4096 && num_query_heads <= 4096,
        source, ": implausible model dimensions");
}

// JSON helpers: a required integer / optional value, with errors naming the file and key.
static long long get_int(const json& c, const char* key, const std::string& source) {
  check(c.contains(key) && c[key].is_number_integer(), source, ": missing or non-integer \"", key, "\"");
  return c[key].get<long long>();
}
static double get_num(const json& c, const char* key, double fallback) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  return c[key].get<double>();
}
static bool get_bool(const json& c, const char* key, bool fallback) {
  if (!c.contains(key) || c[key].is_null()) return fallback;
  return c[key].get<bool>();
}

GemmaConfig GemmaConfig::from_keras_json(const json& j, const std::string& source) {
  check(j.is_object() && j.contains("config") && j["config"].is_object(), source,
        ": not a Keras backbone config (no \"config\" object)");
  std::string cls = j.value("class_name", "");
  check(cls == "GemmaBackbone" || cls == "Gemma3Backbone", source, ": unsupported backbone class \"", cls,
        "\" (expected GemmaBackbone or Gemma3Backbone)");
  const json& c = j["config"];
  GemmaConfig g;
  try {
    g.vocab_size = int(get_int(c, "vocabulary_size", source));
    g.num_layers = int(get_int(c, "num_layers", source));
    g.num_query_heads = int(get_int(c, "num_query_heads", source));
    g.num_key_value_heads = int(get_int(c, "num_key_value_heads", source));
    g.hidden_dim = int(get_int(c, "hidden_dim", source));
    g.head_dim = int(get_int(c, "head_dim", source));
    long long intermediate = get_int(c, "intermediate_dim", source);
    g.layer_norm_epsilon = float(get_num(c, "layer_norm_epsilon", 1e-6));
    g.query_head_dim_normalize = get_bool(c, "query_head_dim_normalize", true);
    g.use_post_attention_norm = get_bool(c, "use_post_attention_norm", false);
    g.use_post_ffw_norm = get_bool(c, "use_post_ffw_norm", false);
    g.final_logit_soft_cap = float(get_num(c, "final_logit_soft_cap", 0));
    g.attention_logit_soft_cap = float(get_num(c, "attention_logit_soft_cap", 0));
    g.use_sliding_window_attention = get_bool(c, "use_sliding_window_attention", false);
    g.sliding_window_size = int(get_num(c, "sliding_window_size", 0));
    if (c.contains("dtype") && c["dtype"].is_object()) g.stored_dtype = c["dtype"]["config"].value("name", "float32");
    else if (c.contains("dtype") && c["dtype"].is_string()) g.stored_dtype = c["dtype"].get<std::string>();
    if (cls == "Gemma3Backbone") {
      g.family = 3;
      g.ffw_dim = int(intermediate);
      g.use_query_key_norm = get_bool(c, "use_query_key_norm", true);
      g.rope_local_scaling = float(get_num(c, "local_rope_scaling_factor", 1.0));
      g.rope_global_scaling = float(get_num(c, "global_rope_scaling_factor", 1.0));
      g.rope_global_base = 1e6f;
      check(c.value("vision_encoder", json()).is_null(), source, ": Gemma 3 vision presets are not supported (text only)");
    } else {
      g.family = (g.use_post_attention_norm || g.use_post_ffw_norm || g.attention_logit_soft_cap > 0) ? 2 : 1;
      check(intermediate % 2 == 0, source, ": intermediate_dim must be even for Gemma 1/2, got ", intermediate);
      g.ffw_dim = int(intermediate / 2);
    }
  } catch (const json::exception& e) {
    fail(source, ": bad config value: ", e.what());
  }
  g.query_scale_dim = g.query_head_dim_normalize ? float(g.head_dim)
                                                 : float(g.hidden_dim) / float(std::max(1, g.num_query_heads));
  g.validate(source);
  return g;
}

GemmaConfig GemmaConfig::from_hf_json(const json& j_in, const std::string& source) {
  check(j_in.is_object(), source, ": not a JSON object");
  std::string type = j_in.value("model_type", "");
  const json* jp = &j_in;
  if (type == "gemma3" && j_in.contains("text_config")) {
    jp = &j_in["text_config"];
    type = "gemma3_text";
  }
  const json& j = *jp;
  GemmaConfig g;
  if (type == "gemma") g.family = 1;
  else if (type == "gemma2") g.family = 2;
  else if (type == "gemma3_text") g.family = 3;
  else fail(source, ": unsupported model_type \"", type, "\" (expected gemma, gemma2, gemma3_text or gemma3)");
  try {
    g.vocab_size = int(get_int(j, "vocab_size", source));
    g.num_layers = int(get_int(j, "num_hidden_layers", source));
    g.num_query_heads = int(get_int(j, "num_attention_heads", source));
    g.num_key_value_heads = int(j.contains("num_key_value_heads") ? get_int(j, "num_key_value_heads", source)
                                                                 : g.num_query_heads);
    g.hidden_dim = int(get_int(j, "hidden_size", source));
    g.head_dim = int(j.contains("head_dim") ? get_int(j, "head_dim", source) : g.hidden_dim / g.num_query_heads);
    g.ffw_dim = int(get_int(j, "intermediate_size", source));
    g.layer_norm_epsilon = float(get_num(j, "rms_norm_eps", 1e-6));
    g.query_scale_dim = float(get_num(j, "query_pre_attn_scalar", g.head_dim));
    g.query_head_dim_normalize = g.query_scale_dim == float(g.head_dim);
    g.rope_local_base = float(get_num(j, "rope_theta", 10000.0));
    g.rope_global_base = g.rope_local_base;
    if (g.family >= 2) {
      g.use_post_attention_norm = g.use_post_ffw_norm = true;
      g.attention_logit_soft_cap = float(get_num(j, "attn_logit_softcapping", 0));
      g.final_logit_soft_cap = float(get_num(j, "final_logit_softcapping", 0));
      g.sliding_window_size = int(get_num(j, "sliding_window", 0));
      g.use_sliding_window_attention = g.sliding_window_size > 0;
    }
    if (g.family == 3) {
      g.use_query_key_norm = true;
      g.rope_global_base = float(get_num(j, "rope_theta", 1e6));
      g.rope_local_base = float(get_num(j, "rope_local_base_freq", 10000.0));
      if (j.contains("rope_scaling") && j["rope_scaling"].is_object())
        g.rope_global_scaling = float(get_num(j["rope_scaling"], "factor", 1.0));
      int pattern = int(get_num(j, "sliding_window_pattern", 6));
      check(pattern == 6 || !g.use_sliding_window_attention, source, ": sliding_window_pattern ", pattern,
            " is not supported (Gemma 3 uses 6)");
    }
    g.stored_dtype = j.value("torch_dtype", "float32");
  } catch (const json::exception& e) {
    fail(source, ": bad config value: ", e.what());
  }
  g.validate(source);
  return g;
}

json GemmaConfig::to_keras_json() const {
  json dtype = {{"module", "keras"}, {"class_name", "DTypePolicy"}, {"config", {{"name", "float32"}}},
                {"registered_name", nullptr}};
  json c = {{"name", family == 3 ? "gemma3_backbone" : "gemma_backbone"},
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
  std::string cls = family == 3 ? "Gemma3Backbone" : "GemmaBackbone";
  std::string module = family == 3 ? "keras_hub.src.models.gemma3.gemma3_backbone" : "keras_hub.src.models.gemma.gemma_backbone";
  return {{"module", module}, {"class_name", cls}, {"config", c}, {"registered_name", "keras_hub>" + cls}};
}

json GemmaConfig::to_hf_json() const {
  static const char* types[] = {"", "gemma", "gemma2", "gemma3_text"};
  static const char* archs[] = {"", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"};
  json j = {{"architectures", {archs[family]}},
            {"model_type", types[family]},
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
            {"torch_dtype", "float32"},
            {"query_pre_attn_scalar", double(query_scale_dim)}};
  if (family >= 2) {
    j["attn_logit_softcapping"] = attention_logit_soft_cap > 0 ? json(double(attention_logit_soft_cap)) : json();
    j["final_logit_softcapping"] = final_logit_soft_cap > 0 ? json(double(final_logit_soft_cap)) : json();
    j["sliding_window"] = use_sliding_window_attention ? json(sliding_window_size) : json();
  }
  if (family == 3) {
    j["rope_local_base_freq"] = double(rope_local_base);
    j["sliding_window_pattern"] = 6;
    if (rope_global_scaling != 1.f) j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", double(rope_global_scaling)}};
  }
  return j;
}

}  // namespace meshtune
