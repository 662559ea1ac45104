// The layout maps users know for Gemma (spec §10), and `--layout auto`: KerasHub's map with the
// key/value kernels replicated over the model axis when the KV heads do not divide it.
#pragma once
#include <string>
#include <vector>

#include "distribution/layout.h"
#include "model/config.h"

namespace meshtune {

// KerasHub GemmaBackbone.get_layout_map(mesh, model_parallel_dim_name, data_parallel_dim_name)
// (current KerasHub): embeddings (model, batch), q/k/v (model, batch, None), attention_output
// (model, None, batch), ffw_gating(_2) (batch, model), ffw_linear (model, batch). With
// `replicate_key_value`, q keeps its rule and k/v get (None, batch, None).
LayoutMap keras_hub_gemma_layout(const std::string& model_axis = "model", const std::string& batch_axis = "batch",
                                 bool replicate_key_value = false);
// The Keras distributed-tuning tutorial's map (new version, spec §10 table, "new TUT").
LayoutMap tutorial_gemma_layout(const std::string& model_axis = "model");

// `--layout auto` for `config` on a mesh of `mesh_shape` / `axis_names`: KerasHub's map, K/V
// replicated over the "model" axis when its size does not divide the KV heads (then `warning`
// says so; else it is left empty).
LayoutMap auto_gemma_layout(const GemmaConfig& config, const std::vector<int>& mesh_shape,
                            const std::vector<std::string>& axis_names, const std::string& batch_axis,
                            std::string& warning);

}  // namespace meshtune
