#include "cli/mesh_options.h"

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

api::DistributionOptions MeshOptions::distribution() const {
  api::DistributionOptions d;
  if (!mesh.empty()) d.mesh_shape = DeviceMesh::parse_shape(mesh);
  if (!axes.empty()) d.axis_names = DeviceMesh::parse_axes(axes);
  d.layout = layout;
  d.layout_rules = rules;
  d.batch_axis = batch_axis;
  d.tensor_parallel = !no_tensor_parallel;
  return d;
}

}  // namespace meshtune::cli
