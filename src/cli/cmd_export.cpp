// meshtune export MODEL --to keras|hf OUT: converts between Keras presets and Hugging Face
// checkpoints (weights keep their stored dtype). With --checkpoint, the trained weights of a
// finetune checkpoint — one file or a sharded run's manifest, its ranks' blocks reassembled — are
// put into MODEL first (LoRA merged), so an interrupted or sharded run becomes one model.
#include <iostream>

#include "cli/commands.h"
#include "core/error.h"

namespace meshtune::cli {

Runner add_export_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("export", "Write a model as a Keras preset or a Hugging Face checkpoint");
  struct Options {
    ModelOptions model;
    std::string to, out, checkpoint;
  };
  auto o = std::make_shared<Options>();
  o->model.add_to(*cmd);
  cmd->add_option("--to", o->to, "keras or hf")->required()->check(CLI::IsMember({"keras", "hf"}));
  cmd->add_option("out", o->out, "Directory to write")->required();
  cmd->add_option("--checkpoint", o->checkpoint,
                  "A finetune checkpoint (DIR/checkpoint.safetensors, also a sharded run's manifest) to apply");
  return [o] {
    check(o->checkpoint.empty() || o->model.lora.empty(), "--checkpoint and --lora cannot be combined");
    api::GemmaCausalLM lm = o->model.load(/*need_tokenizer=*/false);
    if (!o->checkpoint.empty()) lm.apply_checkpoint(o->checkpoint);
    lm.export_model(o->to, o->out);
    std::cerr << "wrote " << o->to << " model to " << o->out << "\n";
    return 0;
  };
}

}  // namespace meshtune::cli
