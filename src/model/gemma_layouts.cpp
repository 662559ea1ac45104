#include "model/gemma_layouts.h"

#include <algorithm>

namespace meshtune {

LayoutMap keras_hub_gemma_layout(const std::string& model_axis, const std::string& batch_axis,
                                 bool replicate_key_value) {
  // The model axis on heads / vocabulary / FFW width, the data axis on the hidden dimension (FSDP-style).
  LayoutMap map;
  map.add("token_embedding/embeddings", {model_axis, batch_axis});
  if (replicate_key_value) {
    map.add("decoder_block.*attention.*query.kernel", {model_axis, batch_axis, std::nullopt});
    map.add("decoder_block.*attention.*(key|value).kernel", {std::nullopt, batch_axis, std::nullopt});
  } else {
    map.add("decoder_block.*attention.*(query|key|value).kernel", {model_axis, batch_axis, std::nullopt});
  }
  map.add("decoder_block.*attention_output.kernel", {model_axis, std::nullopt, batch_axis});
  map.add("decoder_block.*ffw_gating.kernel", {batch_axis, model_axis});
  map.add("decoder_block.*ffw_gating_2.kernel", {batch_axis, model_axis});
  map.add("decoder_block.*ffw_linear.kernel", {model_axis, batch_axis});
  return map;
}

LayoutMap tutorial_gemma_layout(const std::string& model_axis) {
  // The tutorial's current code (spec §10 "new TUT"); "ffw_gating.*kernel" also covers ffw_gating_2.
  LayoutMap map;
  map.add("token_embedding/embeddings", {model_axis, std::nullopt});
  map.add("decoder_block.*attention.*(query|key|value).*kernel", {model_axis, std::nullopt, std::nullopt});
  map.add("decoder_block.*attention_output.*kernel", {model_axis, std::nullopt, std::nullopt});
  map.add("decoder_block.*ffw_gating.*kernel", {std::nullopt, model_axis});
  map.add("decoder_block.*ffw_linear.*kernel", {model_axis, std::nullopt});
  return map;
}

LayoutMap auto_gemma_layout(const GemmaConfig& config, const std::vector<int>& mesh_shape,
                            const std::vector<std::string>& axis_names, const std::string& batch_axis,
                            std::string& warning) {
  const auto model_axis = std::find(axis_names.begin(), axis_names.end(), "model");
  const int model_size = model_axis != axis_names.end() ? mesh_shape[size_t(model_axis - axis_names.begin())] : 1;
  const bool replicate_key_value = config.num_key_value_heads % model_size != 0;
  warning.clear();
  if (replicate_key_value)
    warning = "--layout auto: " + std::to_string(config.num_key_value_heads) +
              " KV head(s) do not divide the 'model' axis of size " + std::to_string(model_size) +
              "; key/value kernels are replicated over it";
  return keras_hub_gemma_layout("model", batch_axis, replicate_key_value);
}

}  // namespace meshtune
