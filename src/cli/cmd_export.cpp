// meshtune export MODEL --to keras|hf OUT: converts between Keras presets and Hugging Face
// checkpoints (weights keep their stored dtype).
#include <iostream>

#include "cli/loading.h"
#include "core/error.h"
#include "model/save.h"

namespace meshtune::cli {

Runner add_export_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("export", "Write a model as a Keras preset or a Hugging Face checkpoint");
  struct Options {
    ModelOptions model;
    std::string to, out;
  };
  auto o = std::make_shared<Options>();
  o->model.add_to(*cmd);
  cmd->add_option("--to", o->to, "keras or hf")->required()->check(CLI::IsMember({"keras", "hf"}));
  cmd->add_option("out", o->out, "Directory to write")->required();
  return [o] {
    LoadedModel loaded = load_model_and_tokenizer(o->model, false);
    if (o->to == "keras")
      save_keras_preset(loaded.model, loaded.dir.tokenizer_path, loaded.dir.sequence_length, o->out);
    else
      save_hf_checkpoint(loaded.model, loaded.dir.tokenizer_path, o->out);
    std::cerr << "wrote " << o->to << " model to " << o->out << "\n";
    return 0;
  };
}

}  // namespace meshtune::cli
