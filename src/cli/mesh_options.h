// The distribution flags shared by finetune and generate: --mesh 1x8 --mesh-axes batch,model
// --layout FILE|auto|tutorial --layout-rule 'REGEX=,model' (Keras' DeviceMesh + LayoutMap +
// ModelParallel(batch_dim_name="batch")).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "distribution/layout.h"
#include "distribution/mesh.h"
#include "model/config.h"
#include "store/load.h"
#include "train/trainer.h"

namespace meshtune::cli {

struct MeshOptions {
  std::string mesh;          // "" = one device per process count: (world size,) DataParallel
  std::string axes;          // default "batch,model" (2-D) / "batch" (1-D)
  std::string layout;        // JSON file, "auto" (KerasHub's Gemma map) or "tutorial"; "" = replicated
  std::vector<std::string> rules;
  std::string batch_axis = "batch";
  bool no_tensor_parallel = false;  // all-gather split weights instead (FSDP-style; for comparison)
  void add_to(CLI::App& app);

  // The mesh shape (--mesh, else one axis of `processes`) and axis names (--mesh-axes, else
  // batch / batch,model). Throw Error on bad text. No processes are needed (info's dry run).
  std::vector<int> shape(int processes) const;
  std::vector<std::string> axis_names(const std::vector<int>& shape) const;
  std::string layout_label() const;  // for messages: "auto (KerasHub …)", the file, "+ N rules"

  // The mesh over this job's processes (nullptr for a plain one-process run without --mesh).
  std::unique_ptr<DeviceMesh> make_mesh() const;
  // With `auto`, key/value kernels are replicated over the model axis (with a warning) when the
  // model's KV heads do not divide it — KerasHub's map fails there (keras-hub#1613).
  LayoutMap make_layout(const GemmaConfig& config, const std::vector<int>& shape,
                        const std::vector<std::string>& axis_names) const;
  Distribution make_distribution(DeviceMesh* mesh, const GemmaConfig& config) const;
};

// For sharded loading (load_model): this process' block of every variable `layout` splits on
// `mesh`, and the row maxima of int8 blocks combined over the mesh. Both must outlive the result.
LoadOptions sharded_loading(const LayoutMap& layout, DeviceMesh& mesh);

}  // namespace meshtune::cli
