// LoRA adapter files other tools load (spec §3.4):
// - Keras `.lora.h5` (Backbone.save_lora_weights): /lora/vars/rank (int64 scalar) and
//   /lora/<idx>/vars/lora_kernel_a|b (fp32), <idx> = the layer's position in Keras'
//   _flatten_layers order (Gemma 1 stride 11: value 8+11i, query 10+11i; Gemma 2 stride 13:
//   value 9+13i, query 11+13i; Gemma 3 stride 15: value 11+15i, query 13+15i; other targets by the
//   same traversal). Keras style only (alpha = rank).
// - Hugging Face PEFT (`adapter_config.json` + `adapter_model.safetensors`, names
//   `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] / `lora_B.weight`
//   [out, r]). A Keras-style adapter is written exactly as PEFT with rank heads·r (A stacked per
//   head, B block-diagonal) via rank_pattern/alpha_pattern so ΔW is identical.
#pragma once
#include <string>

#include "model/lora.h"

namespace meshtune {

// Keras position index of an adapted layer in `_flatten_layers` (the /lora/<idx> group).
int keras_lora_index(const GemmaConfig& config, int layer, Slot slot);

void save_keras_lora(const std::string& path, const GemmaConfig& config, const LoraWeights& lora);  // atomic
LoraWeights load_keras_lora(const std::string& path, const GemmaConfig& config);

// `base_model` is written as base_model_name_or_path (the model trained on, so that PEFT's
// AutoPeftModelForCausalLM can find it); "" when unknown.
void save_peft_adapter(const std::string& dir, const GemmaConfig& config, const LoraWeights& lora,
                       const std::string& base_model = "");  // atomic files
LoraWeights load_peft_adapter(const std::string& dir, const GemmaConfig& config);

// Either format: a path ending in .lora.h5, or a directory with adapter_config.json.
LoraWeights load_lora_adapter(const std::string& path, const GemmaConfig& config);

}  // namespace meshtune
