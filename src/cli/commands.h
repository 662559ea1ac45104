// The meshtune command line: one file per subcommand, each registering its flags on the CLI11 app
// and returning the function that runs it. Results go to stdout, logs and errors to stderr.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "api/causal_lm.h"

namespace meshtune::cli {

// Options every subcommand that loads a model shares.
struct ModelOptions {
  std::string model;       // directory or preset name
  std::string models_dir;  // extra search root for preset names
  bool fp32_weights = false;  // widen bf16-stored weights to fp32 at load
  std::string lora;        // adapter to merge (.lora.h5 or PEFT directory), "" = none
  std::string quantize;    // "int8": quantize the matrices at load (Keras' formula); "" = as stored
  // Keras' dtype policy: float32, mixed_bfloat16 or bfloat16 (bf16 matmul inputs, fp32 sums).
  std::string dtype_policy = "float32";
  std::string device = "cpu";  // cpu | cuda
  void add_to(CLI::App& app, bool with_lora = true, bool required = true);
  void add_dtype_policy(CLI::App& app);
  api::PresetOptions preset() const;  // what GemmaCausalLM::from_preset takes
  api::GemmaCausalLM load(bool need_tokenizer = true) const;
};

using Runner = std::function<int()>;
Runner add_info_command(CLI::App& app);
Runner add_generate_command(CLI::App& app);
Runner add_logits_command(CLI::App& app);
Runner add_init_command(CLI::App& app);
Runner add_export_command(CLI::App& app);
Runner add_finetune_command(CLI::App& app);

}  // namespace meshtune::cli
