#include "cli/mesh_options.h"

#include <iostream>

#include "core/error.h"

namespace meshtune::cli {

void MeshOptions::add_to(CLI::App& app) {
  app.add_option("--mesh", mesh, "Device mesh shape over the processes, e.g. 1x8 (default: one axis of all processes)");
  app.add_option("--mesh-axes", axes, "Mesh axis names (default batch,model for 2-D, batch for 1-D)");
  app.add_option("--layout", layout,
                 "LayoutMap: a JSON file {regex: [axis|null, ...]}, 'auto' (KerasHub's Gemma map) or 'tutorial'");
  app.add_option("--layout-rule", rules, "A layout rule 'REGEX=,model' (repeatable; added to --layout)");
  app.add_option("--batch-axis", batch_axis, "Mesh axis the batch is split over (default batch)");
}

std::unique_ptr<DeviceMesh> MeshOptions::make_mesh() const {
  Communicator& comm = world();
  if (mesh.empty() && comm.size() == 1 && layout.empty() && rules.empty()) return nullptr;
  std::vector<int> shape = mesh.empty() ? std::vector<int>{comm.size()} : DeviceMesh::parse_shape(mesh);
  std::vector<std::string> names =
      !axes.empty() ? DeviceMesh::parse_axes(axes)
                    : shape.size() == 2 ? std::vector<std::string>{"batch", "model"} : std::vector<std::string>{"batch"};
  check(names.size() == shape.size(), "--mesh-axes names ", names.size(), " axes but --mesh ", mesh, " has ",
        shape.size());
  return std::make_unique<DeviceMesh>(shape, names, comm);
}

LayoutMap MeshOptions::make_layout(const GemmaConfig& config, const DeviceMesh* m) const {
  LayoutMap map;
  if (layout == "auto") {
    LayoutMap keras_hub = LayoutMap::keras_hub_gemma("model", batch_axis);
    const int model_axis = m ? m->axis_index("model") : -1;
    const int model_size = model_axis >= 0 ? m->axis_size(model_axis) : 1;
    if (config.num_key_value_heads % model_size == 0) {
      map = keras_hub;
    } else {
      for (const auto& [key, spec] : keras_hub.rules()) {
        if (key.find("(query|key|value)") == std::string::npos) {
          map.add(key, spec);
          continue;
        }
        map.add("decoder_block.*attention.*query.kernel", spec);
        PartitionSpec kv = spec;
        kv[0] = std::nullopt;
        map.add("decoder_block.*attention.*(key|value).kernel", kv);
      }
      if (!m || world().rank() == 0)
        std::cerr << "meshtune: warning: --layout auto: " << config.num_key_value_heads
                  << " KV head(s) do not divide the 'model' axis of size " << model_size
                  << "; key/value kernels are replicated over it\n";
    }
  }
  else if (layout == "tutorial") map = LayoutMap::tutorial_gemma("model");
  else if (!layout.empty()) map = LayoutMap::from_json_file(layout);
  for (const std::string& rule : rules) map.add_rule_text(rule);
  return map;
}

Distribution MeshOptions::make_distribution(DeviceMesh* m, const GemmaConfig& config) const {
  Distribution d;
  d.mesh = m;
  d.layout = make_layout(config, m);
  d.batch_axis = batch_axis;
  return d;
}

}  // namespace meshtune::cli
