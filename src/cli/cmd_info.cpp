// meshtune info MODEL: the config, a Keras-style parameter summary, and every variable with its
// Keras path, shape and dtype (in `backbone.weights` order). With --mesh (and --layout /
// --layout-rule) also a dry run of the sharding: each variable's PartitionSpec, as the distributed
// tutorial prints it, and the parameter bytes one device would hold. No processes are started.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/loading.h"
#include "cli/mesh_options.h"
#include "model/tensor_parallel.h"
#include "core/error.h"
#include "distribution/layout.h"
#include "kernels/cpu/features.h"
#include "model/lora.h"
#include "model/variables.h"

namespace meshtune::cli {

// 1234567 -> "1,234,567"
static std::string with_commas(long long n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// Keras' size label: bytes / 1024^k with two decimals, B/KB/MB/GB.
static std::string keras_size(double bytes) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) { bytes /= 1024; ++u; }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s", bytes, units[u]);
  return buf;
}

static std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string t; std::getline(ss, t, ',');) out.push_back(t);
  return out;
}


Runner add_info_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Show a model's config, parameter summary and variables");
  struct Options {
    ModelOptions model;
    int lora_rank = 0;
    std::string lora_targets = "query,value";
    MeshOptions mesh;  // --mesh "1x8" ("" = no sharding table), --mesh-axes, --layout, --layout-rule
    bool system = false;
  };
  auto o = std::make_shared<Options>();
  o->model.add_to(*cmd, /*with_lora=*/false, /*required=*/false);
  cmd->add_flag("--system", o->system,
                "Show the CPU, its features, the kernel paths in use and the BLAS library (MODEL optional)");
  cmd->add_option("--lora-rank", o->lora_rank, "Show the summary after enable_lora(rank) (trainable vs non-trainable)");
  cmd->add_option("--lora-targets", o->lora_targets, "LoRA targets for --lora-rank (default query,value)");
  o->mesh.add_to(*cmd);  // a dry run here: no processes are started
  return [o] {
    if (o->system) {
      for (const std::string& line : kernel_report()) std::cout << line << "\n";
      if (o->model.model.empty()) return 0;
      std::cout << "\n";
    }
    check(!o->model.model.empty(), "info: MODEL is required (a model directory or preset name), or --system");
    // The mesh flags first: a bad flag fails before the model is read.
    std::vector<int> mesh_shape;
    std::vector<std::string> axis_names;
    const MeshOptions& m = o->mesh;
    if (m.mesh.empty()) {
      check(m.axes.empty() && m.layout.empty() && m.rules.empty(),
            "--mesh-axes, --layout and --layout-rule need --mesh (e.g. --mesh 1x8)");
    } else {
      mesh_shape = m.shape(1);
      axis_names = m.axis_names(mesh_shape);
    }
    const std::string layout_label = m.layout_label();

    LoadedModel loaded = load_model_and_tokenizer(o->model, false);
    const GemmaConfig& c = loaded.model.config;
    const LayoutMap layout = mesh_shape.empty() ? LayoutMap{} : m.make_layout(c, mesh_shape, axis_names);

    // Every variable as Keras lists it: an int8 layer's kernel is int8 and frozen, and its float32
    // scale (kernel_scale, embeddings_scale) is a variable of its own, frozen too.
    struct Row {
      std::string path;
      Shape shape;
      DType dtype;
      bool trainable;
      double bytes() const { return double(num_elements(shape)) * double(dtype_size(dtype)); }
    };
    std::vector<Row> rows;
    const auto vars = gemma_variables(c);
    for (const auto& v : vars) {
      const WeightMatrix* w = loaded.model.matrix(v.slot, v.layer);
      const DType dtype = w ? w->dtype : DType::F32;
      rows.push_back({v.keras_path, v.keras_shape, dtype, dtype != DType::I8});
      if (dtype == DType::I8)
        rows.push_back({keras_layer(v) + (v.slot == Slot::Embeddings ? "/embeddings_scale" : "/kernel_scale"),
                        keras_int8_scale_shape(v), DType::F32, false});
    }
    std::vector<std::pair<std::string, Shape>> lora_vars;
    if (o->lora_rank > 0) {  // enable_lora freezes everything else
      for (Row& r : rows) r.trainable = false;
      std::vector<std::string> targets = split_commas(o->lora_targets);
      LoraWeights lora = enable_lora(c, o->lora_rank, parse_lora_targets(targets), 0);
      for (const LoraAdapter& a : lora.adapters) {
        lora_vars.push_back({a.keras_path(c) + "/lora_kernel_a", a.a_shape});
        lora_vars.push_back({a.keras_path(c) + "/lora_kernel_b", a.b_shape});
      }
    }
    for (const auto& [path, shape] : lora_vars) rows.push_back({path, shape, DType::F32, true});
    long long trainable = 0, frozen = 0;
    double trainable_bytes = 0, frozen_bytes = 0;
    for (const Row& r : rows) {
      (r.trainable ? trainable : frozen) += num_elements(r.shape);
      (r.trainable ? trainable_bytes : frozen_bytes) += r.bytes();
    }
    // Every variable's spec on the mesh, resolved before anything is printed so a bad layout is
    // just an error. Bytes per device = stored bytes / product of the axis sizes splitting it.
    struct Placed {
      std::string path;
      Shape shape;
      PartitionSpec spec;
      double bytes = 0, device_bytes = 0;
    };
    std::vector<Placed> placed;
    std::vector<std::string> warnings;
    if (!mesh_shape.empty()) {
      auto place = [&](const std::string& path, const Shape& shape, size_t elem_bytes) {
        Placed p{path, shape, layout.resolve(path, shape, mesh_shape, axis_names)};
        p.bytes = double(num_elements(shape)) * double(elem_bytes);
        double parts = 1;
        for (const auto& axis : p.spec)
          if (axis) parts *= mesh_shape[size_t(std::find(axis_names.begin(), axis_names.end(), *axis) - axis_names.begin())];
        p.device_bytes = p.bytes / parts;
        for (auto& w : LayoutMap::warnings_for(path, shape, p.spec, mesh_shape)) warnings.push_back(w);
        placed.push_back(std::move(p));
      };
      for (const Row& r : rows) place(r.path, r.shape, dtype_size(r.dtype));
    }

    std::cout << "Model: " << loaded.dir.path << " ("
              << (loaded.dir.format == ModelFormat::Keras ? "Keras preset" : "Hugging Face checkpoint") << ")\n";
    std::cout << "Config: " << c.to_keras_json(c.stored_dtype)["config"].dump() << "\n";
    std::cout << "Family: Gemma " << c.family << ", query scale 1/sqrt(" << c.query_scale_dim << ")"
              << ", sequence_length " << loaded.dir.sequence_length << "\n\n";
    std::cout << "Model: \"" << c.names().keras_prefix << "_causal_lm" << "\"\n";
    std::cout << " Total params: " << with_commas(trainable + frozen) << " (" << keras_size(trainable_bytes + frozen_bytes) << ")\n";
    std::cout << " Trainable params: " << with_commas(trainable) << " (" << keras_size(trainable_bytes) << ")\n";
    std::cout << " Non-trainable params: " << with_commas(frozen) << " (" << keras_size(frozen_bytes) << ")\n\n";

    size_t width = 0;
    for (const Row& r : rows) width = std::max(width, r.path.size());
    std::printf("%-*s  %-22s  %s\n", int(width), "Variable path", "Shape", "Dtype");
    std::cout << std::flush;
    for (const Row& r : rows)
      std::printf("%-*s  %-22s  %s\n", int(width), r.path.c_str(), shape_str(r.shape).c_str(), dtype_name(r.dtype));
    std::fflush(stdout);

    if (!mesh_shape.empty()) {
      std::string mesh_desc = "(", axes_desc = "(";
      long long devices = 1;
      for (size_t i = 0; i < mesh_shape.size(); ++i) {
        mesh_desc += (i ? ", " : "") + std::to_string(mesh_shape[i]);
        axes_desc += (i ? ", '" : "'") + axis_names[i] + "'";
        devices *= mesh_shape[i];
      }
      mesh_desc += mesh_shape.size() == 1 ? ",)" : ")";
      axes_desc += axis_names.size() == 1 ? ",)" : ")";
      std::cout << "\nLayout on mesh " << mesh_desc << " " << axes_desc << ", " << devices << " device"
                << (devices == 1 ? "" : "s") << "; layout map: " << layout_label << "\n";
      for (const auto& p : placed) width = std::max(width, p.path.size());
      std::printf("%-*s  %-22s  %s\n", int(width), "Variable path", "Shape", "PartitionSpec");
      double total_bytes = 0, device_bytes = 0;
      for (const auto& p : placed) {
        std::printf("%-*s  %-22s  %s\n", int(width), p.path.c_str(), shape_str(p.shape).c_str(),
                    partition_spec_str(p.spec).c_str());
        total_bytes += p.bytes;
        device_bytes += p.device_bytes;
      }
      std::printf("Per-device parameter bytes: %s (%s) of %s (%s) in all\n", with_commas((long long)device_bytes).c_str(),
                  keras_size(device_bytes).c_str(), with_commas((long long)total_bytes).c_str(),
                  keras_size(total_bytes).c_str());
      // The biggest variables no axis splits: the first candidates for a layout rule.
      std::vector<const Placed*> replicated;
      for (const auto& p : placed)
        if (std::none_of(p.spec.begin(), p.spec.end(), [](const auto& axis) { return axis.has_value(); }))
          replicated.push_back(&p);
      std::stable_sort(replicated.begin(), replicated.end(), [](const Placed* a, const Placed* b) { return a->bytes > b->bytes; });
      std::string largest;
      for (size_t i = 0; i < replicated.size() && i < 3; ++i)
        largest += (i ? ", " : "") + replicated[i]->path + " (" + with_commas((long long)replicated[i]->bytes) + " B)";
      std::printf("Largest replicated variables: %s\n", largest.empty() ? "none" : largest.c_str());
      const TensorParallelPlan plan =
          plan_tensor_parallel(c, layout, mesh_shape, axis_names, m.batch_axis, {}, !m.no_tensor_parallel);
      std::printf("Compute: %s\n", plan.summary.c_str());
      std::fflush(stdout);
      for (const auto& w : warnings) std::cerr << "meshtune: " << w << "\n";
    }
    return 0;
  };
}

}  // namespace meshtune::cli
