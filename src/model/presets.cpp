#include "model/presets.h"

#include <functional>
#include <map>

#include "core/error.h"

namespace meshtune {

GemmaConfig gemma1_base() {
  GemmaConfig c;
  c.family = 1;
  c.vocab_size = 256000;
  c.head_dim = 256;
  c.query_scale_dim = 256;
  c.max_sequence_length = kGemma12MaxPositions;
  return c;
}

GemmaConfig gemma2_base() {
  GemmaConfig c = gemma1_base();
  c.family = 2;
  c.use_post_attention_norm = c.use_post_ffw_norm = true;
  c.attention_logit_soft_cap = 50;
  c.final_logit_soft_cap = 30;
  c.use_sliding_window_attention = true;
  c.sliding_window_size = 4096;
  c.sliding_window_pattern = 2;
  return c;
}

GemmaConfig gemma3_base() {
  GemmaConfig c = gemma1_base();
  c.family = 3;
  c.vocab_size = 262144;
  c.use_post_attention_norm = c.use_post_ffw_norm = c.use_query_key_norm = true;
  c.use_sliding_window_attention = true;
  c.sliding_window_size = 1024;
  c.sliding_window_pattern = 6;
  c.rope_global_base = 1e6f;
  c.rope_global_scaling = 8.f;  // 4b and larger; the 270m and 1b models use 1
  c.max_sequence_length = kGemma3MaxPositions;
  c.stop_tokens = {"<end_of_turn>"};
  return c;
}

// Layers, query heads, KV heads, hidden size, FFN width (one gating matrix), head size.
static GemmaConfig shape(GemmaConfig c, int L, int N, int K, int D, int F, int H) {
  c.num_layers = L, c.num_query_heads = N, c.num_key_value_heads = K, c.hidden_dim = D, c.ffw_dim = F, c.head_dim = H;
  c.query_scale_dim = float(H);
  return c;
}

// The tiny shapes: 2 layers, 4 query heads of 16, hidden 64, FFN 128.
static GemmaConfig tiny(GemmaConfig c, int K) {
  c = shape(c, 2, 4, K, 64, 128, 16);
  c.sliding_window_size = 8;
  return c;
}

static const std::map<std::string, std::function<GemmaConfig()>>& presets() {
  static const std::map<std::string, std::function<GemmaConfig()>> table = {
      {"gemma_2b_en", [] { return shape(gemma1_base(), 18, 8, 1, 2048, 16384, 256); }},
      {"gemma_7b_en", [] { return shape(gemma1_base(), 28, 16, 16, 3072, 24576, 256); }},
      {"gemma2_2b_en", [] { return shape(gemma2_base(), 26, 8, 4, 2304, 9216, 256); }},
      {"gemma2_9b_en", [] { return shape(gemma2_base(), 42, 16, 8, 3584, 14336, 256); }},
      {"gemma2_27b_en",
       [] {
         GemmaConfig c = shape(gemma2_base(), 46, 32, 16, 4608, 36864, 128);
         c.query_head_dim_normalize = false;  // queries scaled by 1/sqrt(hidden / heads) = 1/sqrt(144)
         c.query_scale_dim = 144;
         return c;
       }},
      {"gemma3_270m",
       [] {
         GemmaConfig c = shape(gemma3_base(), 18, 4, 1, 640, 2048, 256);
         c.sliding_window_size = 512, c.rope_global_scaling = 1;
         return c;
       }},
      {"gemma3_1b",
       [] {
         GemmaConfig c = shape(gemma3_base(), 26, 4, 1, 1152, 6912, 256);
         c.sliding_window_size = 512, c.rope_global_scaling = 1;
         return c;
       }},
      {"gemma3_4b", [] { return shape(gemma3_base(), 34, 8, 4, 2560, 10240, 256); }},
      {"gemma3_12b", [] { return shape(gemma3_base(), 48, 16, 8, 3840, 15360, 256); }},
      {"gemma3_27b",
       [] {
         GemmaConfig c = shape(gemma3_base(), 62, 32, 16, 5376, 21504, 128);
         c.query_head_dim_normalize = false;
         c.query_scale_dim = 168;  // hidden / heads
         return c;
       }},
      {"tiny", [] { return tiny(gemma1_base(), 1); }},
      {"tiny-gemma2", [] { return tiny(gemma2_base(), 2); }},
      {"tiny-gemma3",
       [] {
         GemmaConfig c = tiny(gemma3_base(), 2);
         c.num_layers = 6;  // one whole local/global period
         c.rope_global_scaling = 1;
         return c;
       }},
  };
  return table;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, make] : presets()) names.push_back(name);
  return names;
}

GemmaConfig preset_config(const std::string& name, int vocab_size) {
  std::string key = name;
  // KerasHub's instruction-tuned presets have their base's shape.
  for (const std::string tag : {"_instruct", "_it"})
    if (const size_t at = key.find(tag); at != std::string::npos) key.erase(at, tag.size());
  if (key.rfind("gemma3_", 0) == 0 && key.size() > 5 && key.compare(key.size() - 5, 5, "_text") == 0)
    key.erase(key.size() - 5);  // gemma3_4b_text: the text part of a vision preset
  const auto it = presets().find(key);
  if (it == presets().end()) {
    std::string known;
    for (const std::string& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    fail("unknown config '", name, "' (known: ", known, ")");
  }
  GemmaConfig c = it->second();
  if (vocab_size > 0) c.vocab_size = vocab_size;
  c.validate("config " + name);
  return c;
}

}  // namespace meshtune
