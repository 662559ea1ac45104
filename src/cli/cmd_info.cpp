// meshtune info MODEL: the config, a Keras-style parameter summary, and every variable with its
// Keras path, shape and dtype (in `backbone.weights` order).
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/loading.h"
#include "model/lora.h"
#include "model/variables.h"
#include <sstream>

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

static const char* stored_dtype(const GemmaModel& m, const VariableSpec& spec) {
  const DecoderLayerWeights* l = spec.layer >= 0 ? &m.layers[size_t(spec.layer)] : nullptr;
  const WeightMatrix* w = nullptr;
  switch (spec.slot) {
    case Slot::Embeddings: w = &m.embeddings; break;
    case Slot::Query: w = &l->query; break;
    case Slot::Key: w = &l->key; break;
    case Slot::Value: w = &l->value; break;
    case Slot::AttentionOutput: w = &l->attention_output; break;
    case Slot::FfwGating: w = &l->ffw_gating; break;
    case Slot::FfwGating2: w = &l->ffw_gating_2; break;
    case Slot::FfwLinear: w = &l->ffw_linear; break;
    default: return "float32";
  }
  return dtype_name(w->dtype);
}

Runner add_info_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Show a model's config, parameter summary and variables");
  struct Options {
    ModelOptions model;
    int lora_rank = 0;
    std::string lora_targets = "query,value";
  };
  auto o = std::make_shared<Options>();
  o->model.add_to(*cmd, /*with_lora=*/false);
  cmd->add_option("--lora-rank", o->lora_rank, "Show the summary after enable_lora(rank) (trainable vs non-trainable)");
  cmd->add_option("--lora-targets", o->lora_targets, "LoRA targets for --lora-rank (default query,value)");
  return [o] {
    LoadedModel loaded = load_model_and_tokenizer(o->model, false);
    const GemmaConfig& c = loaded.model.config;
    std::cout << "Model: " << loaded.dir.path << " ("
              << (loaded.dir.format == ModelFormat::Keras ? "Keras preset" : "Hugging Face checkpoint") << ")\n";
    std::cout << "Config: " << c.to_keras_json()["config"].dump() << "\n";
    std::cout << "Family: Gemma " << c.family << ", query scale 1/sqrt(" << c.query_scale_dim << ")"
              << ", sequence_length " << loaded.dir.sequence_length << "\n\n";

    long long total = 0;
    double bytes = 0;
    auto vars = gemma_variables(c);
    for (const auto& v : vars) {
      long long n = num_elements(v.keras_shape);
      total += n;
      bytes += double(n) * double(dtype_size(std::string(stored_dtype(loaded.model, v)) == "bfloat16" ? DType::BF16 : DType::F32));
    }
    std::vector<std::pair<std::string, Shape>> lora_vars;
    long long trainable = total;
    double trainable_bytes = bytes;
    if (o->lora_rank > 0) {
      std::vector<std::string> targets;
      std::stringstream ss(o->lora_targets);
      for (std::string t; std::getline(ss, t, ',');) targets.push_back(t);
      LoraWeights lora = enable_lora(c, o->lora_rank, parse_lora_targets(targets), 0);
      trainable = lora.num_parameters();
      trainable_bytes = double(trainable) * 4;
      for (const LoraAdapter& a : lora.adapters) {
        lora_vars.push_back({a.keras_path(c) + "/lora_kernel_a", a.a_shape});
        lora_vars.push_back({a.keras_path(c) + "/lora_kernel_b", a.b_shape});
      }
    }
    const long long frozen = o->lora_rank > 0 ? total : 0;
    std::cout << "Model: \"" << (c.family == 3 ? "gemma3_causal_lm" : "gemma_causal_lm") << "\"\n";
    std::cout << " Total params: " << with_commas(frozen + trainable) << " (" << keras_size((frozen ? bytes : 0) + trainable_bytes) << ")\n";
    std::cout << " Trainable params: " << with_commas(trainable) << " (" << keras_size(trainable_bytes) << ")\n";
    std::cout << " Non-trainable params: " << with_commas(frozen) << " (" << keras_size(frozen ? bytes : 0) << ")\n\n";

    size_t width = 0;
    for (const auto& v : vars) width = std::max(width, v.keras_path.size());
    std::printf("%-*s  %-22s  %s\n", int(width), "Variable path", "Shape", "Dtype");
    std::cout << std::flush;
    for (const auto& v : vars)
      std::printf("%-*s  %-22s  %s\n", int(width), v.keras_path.c_str(), shape_str(v.keras_shape).c_str(),
                  stored_dtype(loaded.model, v));
    for (const auto& [path, shape] : lora_vars)
      std::printf("%-*s  %-22s  %s\n", int(width), path.c_str(), shape_str(shape).c_str(), "float32");
    std::fflush(stdout);
    return 0;
  };
}

}  // namespace meshtune::cli
