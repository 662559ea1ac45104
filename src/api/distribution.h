// How a model is spread over processes, in Keras' terms: a DeviceMesh (shape + axis names over the
// job's processes), a LayoutMap of regex rules (a JSON file, KerasHub's Gemma map "auto", the
// tutorial's map "tutorial", and rules given as text or as a LayoutMap), and the mesh axis the
// batch is split over (ModelParallel's batch_dim_name). The command line's --mesh flags and the
// Python package's keras.distribution objects both fill one of these.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "distribution/layout.h"
#include "distribution/mesh.h"
#include "model/config.h"
#include "store/load.h"
#include "train/trainer.h"

namespace meshtune::api {

struct DistributionOptions {
  std::vector<int> mesh_shape;          // empty: one axis over every process (DataParallel), or none at all
  std::vector<std::string> axis_names;  // empty: ("batch", "model") for 2-D, ("batch",) for 1-D
  std::string layout;                   // a JSON file, "auto" (KerasHub's Gemma map), "tutorial", or "" (none)
  std::vector<std::string> layout_rules;  // "REGEX=,model" texts, added after `layout`
  LayoutMap layout_map;                   // rules added after those (the Python LayoutMap's entries)
  std::string batch_axis = "batch";
  bool tensor_parallel = true;  // false: all-gather split weights before use (FSDP-style; for comparison)

  // True when nothing was asked for: a plain run (one process, no mesh).
  bool empty() const;
  // The mesh shape (mesh_shape, else one axis of `processes`) and axis names. Throw Error on a
  // mismatch. No processes are needed (info's dry run).
  std::vector<int> shape(int processes) const;
  std::vector<std::string> names(const std::vector<int>& shape) const;
  std::string layout_label() const;  // for messages: "auto (KerasHub …)", the file, "+ N rules"
  // With "auto", key/value kernels are replicated over the model axis (with a warning, given to
  // `warning`) when the model's KV heads do not divide it — KerasHub's map fails there (keras-hub#1613).
  LayoutMap make_layout(const GemmaConfig& config, const std::vector<int>& shape,
                        const std::vector<std::string>& axis_names, std::string* warning = nullptr) const;
  // Whether this job needs a mesh: a distribution was given, or it runs several processes.
  bool wants_mesh() const;
  // The mesh over this job's processes, their collectives through `comm` (world(), or the device
  // communicator over it of a mesh of GPUs); nullptr when !wants_mesh().
  std::unique_ptr<DeviceMesh> make_mesh(Communicator& comm) const;
};

// For sharded loading (load_model): this process' block of every variable `layout` splits on
// `mesh`, and the row maxima of int8 blocks combined over the mesh. Both must outlive the result.
LoadOptions sharded_loading(const LayoutMap& layout, DeviceMesh& mesh);

}  // namespace meshtune::api
