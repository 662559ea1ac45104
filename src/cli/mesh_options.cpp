#include "cli/mesh_options.h"

#include <algorithm>
#include <iostream>

#include "core/error.h"
#include "distribution/sharding.h"
#include "model/gemma_layouts.h"
#include "model/sharded_model.h"

namespace meshtune::cli {

void MeshOptions::add_to(CLI::App& app) {
  app.add_option("--mesh", mesh, "Device mesh shape over the processes, e.g. 1x8 (default: one axis of all processes)");
  app.add_option("--mesh-axes", axes, "Mesh axis names (default batch,model for 2-D, batch for 1-D)");
  app.add_option("--layout", layout,
                 "LayoutMap: a JSON file {regex: [axis|null, ...]}, 'auto' (KerasHub's Gemma map) or 'tutorial'");
  app.add_option("--layout-rule", rules, "A layout rule 'REGEX=,model' (repeatable; added to --layout)");
  app.add_option("--batch-axis", batch_axis, "Mesh axis the batch is split over (default batch)");
  app.add_flag("--no-tensor-parallel", no_tensor_parallel,
               "All-gather split weights before use instead of computing heads/FFN width split (for comparison)");
}

std::vector<int> MeshOptions::shape(int processes) const {
  return mesh.empty() ? std::vector<int>{processes} : DeviceMesh::parse_shape(mesh);
}

std::vector<std::string> MeshOptions::axis_names(const std::vector<int>& s) const {
  if (axes.empty()) {
    check(s.size() <= 2, "--mesh ", mesh, " has ", s.size(), " axes: name them with --mesh-axes");
    return s.size() == 2 ? std::vector<std::string>{"batch", "model"} : std::vector<std::string>{"batch"};
  }
  std::vector<std::string> names = DeviceMesh::parse_axes(axes);
  check(names.size() == s.size(), "--mesh-axes '", axes, "' names ", names.size(), " axes but --mesh ", mesh,
        " has ", s.size());
  return names;
}

std::string MeshOptions::layout_label() const {
  std::string label = layout == "auto"       ? "auto (KerasHub GemmaBackbone.get_layout_map)"
                      : layout == "tutorial" ? "tutorial (Keras distributed tuning guide)"
                      : layout.empty()       ? ""
                                             : layout;
  if (!rules.empty())
    label += (label.empty() ? "" : " + ") + std::to_string(rules.size()) + (rules.size() == 1 ? " rule" : " rules") +
             " from --layout-rule";
  return label.empty() ? "none (every variable replicated)" : label;
}

std::unique_ptr<DeviceMesh> MeshOptions::make_mesh() const {
  Communicator& comm = world();
  if (mesh.empty() && comm.size() == 1 && layout.empty() && rules.empty()) return nullptr;
  const std::vector<int> s = shape(comm.size());
  return std::make_unique<DeviceMesh>(s, axis_names(s), comm);
}

LayoutMap MeshOptions::make_layout(const GemmaConfig& config, const std::vector<int>& s,
                                   const std::vector<std::string>& names) const {
  LayoutMap map;
  if (layout == "auto") {
    std::string warning;
    map = auto_gemma_layout(config, s, names, batch_axis, warning);
    if (!warning.empty() && world().rank() == 0) std::cerr << "meshtune: warning: " << warning << "\n";
  }
  else if (layout == "tutorial") map = tutorial_gemma_layout("model");
  else if (!layout.empty()) map = LayoutMap::from_json_file(layout);
  for (const std::string& rule : rules) map.add_rule_text(rule);
  return map;
}

Distribution MeshOptions::make_distribution(DeviceMesh* m, const GemmaConfig& config) const {
  Distribution d;
  d.mesh = m;
  if (m) d.layout = make_layout(config, m->shape(), m->axis_names());
  d.batch_axis = batch_axis;
  d.tensor_parallel = !no_tensor_parallel;
  return d;
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

}  // namespace meshtune::cli
