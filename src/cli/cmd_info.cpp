// meshtune info MODEL: the config, a Keras-style parameter summary, and every variable with its
// Keras path, shape and dtype (in `backbone.weights` order). With --mesh (and --layout /
// --layout-rule) also a dry run of the sharding: each variable's PartitionSpec, as the distributed
// tutorial prints it, and the parameter bytes one device would hold. No processes are started.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "backend/cpu_backend.h"
#include "backend/cpu/routes.h"
#include "backend/cuda_devices.h"
#include "cli/commands.h"
#include "cli/mesh_options.h"
#include "core/error.h"
#include "distribution/layout.h"
#include "model/tensor_parallel.h"

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



namespace {
struct Options {
  ModelOptions model;
  int lora_rank = 0;
  int batch_size = 2, seq_len = 0;  // the training-memory estimate's shape (0: the preset's sequence_length)
  std::string lora_targets = "query,value";
  MeshOptions mesh;  // --mesh "1x8" ("" = no sharding table), --mesh-axes, --layout, --layout-rule
  bool system = false;
  bool recalibrate = false;
};
}  // namespace

static void print_variables(const api::GemmaCausalLM& lm, const std::vector<api::VariableInfo>& rows) {
  const GemmaConfig& c = lm.config();
  const api::ParameterSummary s = lm.summary();
  std::cout << "Model: " << lm.directory().path << " ("
            << (lm.directory().format == ModelFormat::Keras ? "Keras preset" : "Hugging Face checkpoint") << ")\n";
  std::cout << "Config: " << c.to_keras_json(c.stored_dtype)["config"].dump() << "\n";
  std::cout << "Family: Gemma " << c.family << ", query scale 1/sqrt(" << c.query_scale_dim << ")"
            << ", sequence_length " << lm.sequence_length() << "\n\n";
  std::cout << "Model: \"" << c.names().keras_prefix << "_causal_lm" << "\"\n";
  std::cout << " Total params: " << with_commas(s.total) << " (" << keras_size(s.total_bytes) << ")\n";
  std::cout << " Trainable params: " << with_commas(s.trainable) << " (" << keras_size(s.trainable_bytes) << ")\n";
  std::cout << " Non-trainable params: " << with_commas(s.non_trainable) << " (" << keras_size(s.non_trainable_bytes)
            << ")\n\n";
  size_t width = 0;
  for (const api::VariableInfo& r : rows) width = std::max(width, r.path.size());
  std::cout << std::flush;
  std::printf("%-*s  %-22s  %s\n", int(width), "Variable path", "Shape", "Dtype");
  for (const api::VariableInfo& r : rows)
    std::printf("%-*s  %-22s  %s\n", int(width), r.path.c_str(), shape_str(r.shape).c_str(), dtype_name(r.dtype));
  std::fflush(stdout);
}

// The dry run of a mesh: each variable's PartitionSpec, the bytes one device holds, the largest
// replicated variables and the compute plan.
static void print_layout(const api::GemmaCausalLM& lm, const std::vector<api::VariableInfo>& rows,
                         const api::DistributionOptions& d) {
  const std::vector<int> shape = d.shape(1);
  const std::vector<std::string> names = d.names(shape);
  std::string mesh_desc = "(", axes_desc = "(";
  long long devices = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    mesh_desc += (i ? ", " : "") + std::to_string(shape[i]);
    axes_desc += (i ? ", '" : "'") + names[i] + "'";
    devices *= shape[i];
  }
  mesh_desc += shape.size() == 1 ? ",)" : ")";
  axes_desc += names.size() == 1 ? ",)" : ")";
  std::cout << "\nLayout on mesh " << mesh_desc << " " << axes_desc << ", " << devices << " device"
            << (devices == 1 ? "" : "s") << "; layout map: " << d.layout_label() << "\n";
  size_t width = 0;
  for (const api::VariableInfo& r : rows) width = std::max(width, r.path.size());
  std::printf("%-*s  %-22s  %s\n", int(width), "Variable path", "Shape", "PartitionSpec");
  double total_bytes = 0, device_bytes = 0;
  std::vector<std::pair<double, std::string>> replicated;
  std::vector<std::string> warnings;
  for (const api::VariableInfo& r : rows) {
    std::printf("%-*s  %-22s  %s\n", int(width), r.path.c_str(), shape_str(r.shape).c_str(),
                partition_spec_str(r.sharding).c_str());
    double parts = 1;  // bytes per device = stored bytes / product of the axis sizes splitting it
    for (const auto& axis : r.sharding)
      if (axis) parts *= shape[size_t(std::find(names.begin(), names.end(), *axis) - names.begin())];
    total_bytes += r.bytes();
    device_bytes += r.bytes() / parts;
    if (parts == 1) replicated.push_back({r.bytes(), r.path});
    for (auto& w : LayoutMap::warnings_for(r.path, r.shape, r.sharding, shape)) warnings.push_back(w);
  }
  std::printf("Per-device parameter bytes: %s (%s) of %s (%s) in all\n", with_commas((long long)device_bytes).c_str(),
              keras_size(device_bytes).c_str(), with_commas((long long)total_bytes).c_str(),
              keras_size(total_bytes).c_str());
  // The biggest variables no axis splits: the first candidates for a layout rule.
  std::stable_sort(replicated.begin(), replicated.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string largest;
  for (size_t i = 0; i < replicated.size() && i < 3; ++i)
    largest += (i ? ", " : "") + replicated[i].second + " (" + with_commas((long long)replicated[i].first) + " B)";
  std::printf("Largest replicated variables: %s\n", largest.empty() ? "none" : largest.c_str());
  std::string warning;
  const LayoutMap layout = d.make_layout(lm.config(), shape, names, &warning);
  const TensorParallelPlan plan =
      plan_tensor_parallel(lm.config(), layout, shape, names, d.batch_axis, {}, d.tensor_parallel);
  std::printf("Compute: %s\n", plan.summary.c_str());
  std::fflush(stdout);
  if (!warning.empty()) warnings.insert(warnings.begin(), "warning: " + warning);
  for (const auto& w : warnings) std::cerr << "meshtune: " << w << "\n";
}

// The GPUs --device cuda can use, or why there are none.
static std::vector<std::string> gpu_report() {
  const CudaSystem system = cuda_system();
  auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  std::vector<std::string> lines;
  if (!system.built) return {"GPUs: none usable (" + system.unavailable + ")"};
  lines.push_back("CUDA: runtime " + version(system.runtime_version) + ", driver " +
                  (system.driver_version ? version(system.driver_version) : std::string("none")));
  if (!system.unavailable.empty()) lines.push_back("GPUs: none usable (" + system.unavailable + ")");
  for (const GpuInfo& gpu : system.gpus)
    lines.push_back("GPU " + std::to_string(gpu.index) + ": " + gpu.name + ", " +
                    std::to_string(gpu.memory_bytes >> 20) + " MiB, compute capability " + std::to_string(gpu.major) +
                    "." + std::to_string(gpu.minor));
  return lines;
}

static int run_info(const Options& o) {
  check(!o.recalibrate || o.system, "--recalibrate needs --system (it measures the matrix products' routes again)");
  if (o.system) {
    if (o.recalibrate) recalibrate_routes();
    for (const std::string& line : CpuBackend().report()) std::cout << line << "\n";
    for (const std::string& line : gpu_report()) std::cout << line << "\n";
    if (o.model.model.empty()) return 0;
    std::cout << "\n";
  }
  check(!o.model.model.empty(), "info: MODEL is required (a model directory or preset name), or --system");
  // The mesh flags first: a bad flag fails before the model is read. No processes are started.
  const api::DistributionOptions dry_run = o.mesh.distribution();
  const bool mesh = !o.mesh.mesh.empty();
  if (!mesh)
    check(o.mesh.axes.empty() && o.mesh.layout.empty() && o.mesh.rules.empty(),
          "--mesh-axes, --layout and --layout-rule need --mesh (e.g. --mesh 1x8)");
  else
    dry_run.names(dry_run.shape(1));
  check(o.batch_size >= 1, "--batch-size must be at least 1, got ", o.batch_size);
  check(o.seq_len >= 0, "--seq-len must be at least 1, got ", o.seq_len);
  api::GemmaCausalLM lm = o.model.load(/*need_tokenizer=*/false);
  if (o.lora_rank > 0) lm.enable_lora({o.lora_rank, api::split_commas(o.lora_targets), 0, 0});  // freezes the rest
  // Every variable's spec on the mesh, resolved before anything is printed so a bad layout is just an error.
  const std::vector<api::VariableInfo> rows = lm.variables_on(dry_run, mesh);
  print_variables(lm, rows);
  if (mesh) print_layout(lm, rows, dry_run);
  const int length = o.seq_len > 0 ? o.seq_len : lm.sequence_length();
  std::cout << "\nTraining memory (one process, batch " << o.batch_size << " × sequence_length " << length << ", "
            << (lm.lora() ? "LoRA rank " + std::to_string(lm.lora()->rank) : std::string("all weights")) << ", "
            << lm.options().dtype_policy << "): about " << lm.training_memory(o.batch_size, length).summary() << "\n";
  return 0;
}

Runner add_info_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Show a model's config, parameter summary and variables");
  auto o = std::make_shared<Options>();
  o->model.add_to(*cmd, /*with_lora=*/false, /*required=*/false);
  cmd->add_flag("--system", o->system,
                "Show the CPU, its features, the kernel paths in use and the BLAS library (MODEL optional)");
  cmd->add_flag("--recalibrate", o->recalibrate,
                "With --system: measure the matrix products' routes again instead of reading the cache");
  cmd->add_option("--lora-rank", o->lora_rank, "Show the summary after enable_lora(rank) (trainable vs non-trainable)");
  cmd->add_option("--lora-targets", o->lora_targets, "LoRA targets for --lora-rank (default query,value)");
  cmd->add_option("--batch-size", o->batch_size, "Batch size of the training-memory estimate (default 2)");
  cmd->add_option("--seq-len", o->seq_len, "Sequence length of the training-memory estimate (default: the preset's)");
  o->mesh.add_to(*cmd);  // a dry run here: no processes are started
  return [o] { return run_info(*o); };
}

}  // namespace meshtune::cli
