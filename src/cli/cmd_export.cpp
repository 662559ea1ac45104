// meshtune export MODEL --to keras|hf OUT: converts between Keras presets and Hugging Face
// checkpoints (weights keep their stored dtype). With --checkpoint, the trained weights of a
// finetune checkpoint — one file or a sharded run's manifest, its ranks' blocks reassembled — are
// put into MODEL first (LoRA merged), so an interrupted or sharded run becomes one model.
#include <algorithm>
#include <iostream>

#include "cli/loading.h"
#include "core/error.h"
#include "model/sharded_model.h"
#include "model/lora.h"
#include "store/save.h"
#include "store/checkpoint.h"

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
    LoadedModel loaded = load_model_and_tokenizer(o->model, false);
    if (loaded.lora) {  // attached as low-rank terms over int8 weights: exporting merges and re-quantizes
      loaded.model.low_rank.clear();
      loaded.model = merge_lora(loaded.model, *loaded.lora);
    }
    if (!o->checkpoint.empty()) {
      const GemmaConfig& c = loaded.model.config;
      TrainedParameters trained = read_trained_parameters(o->checkpoint);
      auto take = [&](const std::string& path, size_t size) {
        auto it = trained.values.find(path);
        check(it != trained.values.end(), o->checkpoint, ": no ", path, " (a checkpoint of another model?)");
        check(it->second.size() == size, o->checkpoint, ": ", path, " has ", it->second.size(), " values, ",
              loaded.dir.config_path, " implies ", size);
        std::vector<float> values = std::move(it->second);
        trained.values.erase(it);
        return values;
      };
      if (trained.mode == "full") {
        for (const VariableSpec& spec : gemma_variables(c))
          set_variable(loaded.model, spec, take(spec.keras_path, size_t(num_elements(spec.hf_shape))));
      } else {
        // The adapters' targets, from the checkpoint's paths ".../<target>/lora_kernel_a".
        std::vector<std::string> targets;
        for (const auto& [path, values] : trained.values) {
          const size_t end = path.rfind("/lora_kernel_a");
          if (end == std::string::npos) continue;
          const std::string target = path.substr(path.rfind('/', end - 1) + 1, end - path.rfind('/', end - 1) - 1);
          if (std::find(targets.begin(), targets.end(), target) == targets.end()) targets.push_back(target);
        }
        LoraWeights lora = enable_lora(c, trained.lora_rank, parse_lora_targets(targets), 0, trained.lora_alpha);
        for (LoraAdapter& ad : lora.adapters) {
          ad.a = take(ad.keras_path(c) + "/lora_kernel_a", ad.a.size());
          ad.b = take(ad.keras_path(c) + "/lora_kernel_b", ad.b.size());
        }
        loaded.model = merge_lora(loaded.model, lora);
      }
      check(trained.values.empty(), o->checkpoint, ": ", trained.values.size(), " weights do not belong to ",
            loaded.dir.path, " (first: ", trained.values.empty() ? "" : trained.values.begin()->first, ")");
      std::cerr << "applied " << trained.mode << " weights of step " << trained.step << " from " << o->checkpoint << "\n";
    }
    if (o->to == "keras")
      save_keras_preset(loaded.model, loaded.dir.tokenizer_path, loaded.dir.sequence_length, o->out);
    else
      save_hf_checkpoint(loaded.model, loaded.dir.tokenizer_path, o->out);
    std::cerr << "wrote " << o->to << " model to " << o->out << "\n";
    return 0;
  };
}

}  // namespace meshtune::cli
