#include "api/distribution.h"

#include "core/error.h"
#include "distribution/sharding.h"
#include "model/gemma_layouts.h"
#include "model/sharded_model.h"

namespace meshtune::api {

bool DistributionOptions::empty() const {
  return mesh_shape.empty() && axis_names.empty() && layout.empty() && layout_rules.empty() && layout_map.empty();
}

std::vector<int> DistributionOptions::shape(int processes) const {
  return mesh_shape.empty() ? std::vector<int>{processes} : mesh_shape;
}

std::vector<std::string> DistributionOptions::names(const std::vector<int>& s) const {
  if (axis_names.empty()) {
    check(s.size() <= 2, "a mesh of ", s.size(), " axes needs axis names (--mesh-axes)");
    return s.size() == 2 ? std::vector<std::string>{"batch", "model"} : std::vector<std::string>{"batch"};
  }
  check(axis_names.size() == s.size(), "the mesh axis names (--mesh-axes) name ", axis_names.size(),
        " axes but the mesh shape (--mesh) has ", s.size());
  return axis_names;
}

std::string DistributionOptions::layout_label() const {
  std::string label = layout == "auto"       ? "auto (KerasHub GemmaBackbone.get_layout_map)"
                      : layout == "tutorial" ? "tutorial (Keras distributed tuning guide)"
                                             : layout;
  const size_t rules = layout_rules.size() + layout_map.rules().size();
  if (rules > 0)
    label += (label.empty() ? "" : " + ") + std::to_string(rules) + (rules == 1 ? " rule" : " rules");
  return label.empty() ? "none (every variable replicated)" : label;
}

LayoutMap DistributionOptions::make_layout(const GemmaConfig& config, const std::vector<int>& s,
                                           const std::vector<std::string>& names, std::string* warning) const {
  LayoutMap map;
  if (layout == "auto") {
    std::string w;
    map = auto_gemma_layout(config, s, names, batch_axis, w);
    if (warning) *warning = w;
  } else if (layout == "tutorial") {
    map = tutorial_gemma_layout("model");
  } else if (!layout.empty()) {
    map = LayoutMap::from_json_file(layout);
  }
  for (const std::string& rule : layout_rules) map.add_rule_text(rule);
  for (const auto& [key, spec] : layout_map.rules()) map.add(key, spec);
  return map;
}

bool DistributionOptions::wants_mesh() const { return !empty() || world().size() > 1; }

std::unique_ptr<DeviceMesh> DistributionOptions::make_mesh(Communicator& comm) const {
  if (!wants_mesh()) return nullptr;
  const std::vector<int> s = shape(comm.size());
  return std::make_unique<DeviceMesh>(s, names(s), comm);
}

LoadOptions sharded_loading(const LayoutMap& layout, DeviceMesh& mesh) {
  LoadOptions options;
  options.block_of = [&layout, &mesh](const VariableSpec& spec) -> std::optional<ShardSpec> {
    const ShardSpec s = make_shard_spec(our_dimensions(spec.kind), spec.keras_shape,
                                        layout.resolve(spec.keras_path, spec.keras_shape, mesh), mesh);
    if (s.local_size() == s.full_size()) return std::nullopt;
    return s;
  };
  options.combine_row_max = [&mesh](const VariableSpec& spec, const ShardSpec& block, float* row_max) {
    combine_row_maxima(spec, block, mesh, row_max);
  };
  return options;
}

}  // namespace meshtune::api
