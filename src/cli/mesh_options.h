// The distribution flags shared by finetune, generate and info: --mesh 1x8 --mesh-axes batch,model
// --layout FILE|auto|tutorial --layout-rule 'REGEX=,model' (Keras' DeviceMesh + LayoutMap +
// ModelParallel(batch_dim_name="batch")), parsed into the library's DistributionOptions.
#pragma once
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "api/distribution.h"

namespace meshtune::cli {

struct MeshOptions {
  std::string mesh;          // "" = one axis over the processes (DataParallel), or no mesh at all
  std::string axes;          // default "batch,model" (2-D) / "batch" (1-D)
  std::string layout;        // JSON file, "auto" (KerasHub's Gemma map) or "tutorial"; "" = replicated
  std::vector<std::string> rules;
  std::string batch_axis = "batch";
  bool no_tensor_parallel = false;  // all-gather split weights instead (FSDP-style; for comparison)
  void add_to(CLI::App& app);
  // Throws Error on bad text (a shape that is not 1x8-like, axis names that are not identifiers).
  api::DistributionOptions distribution() const;
};

}  // namespace meshtune::cli
