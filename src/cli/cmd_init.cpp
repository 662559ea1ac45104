// meshtune init [--config tiny] [--dtype float32|bfloat16] [--format keras|hf] [--seed N] OUT
// Writes the embedded default: a small random Gemma model as a real preset directory, with a
// SentencePiece tokenizer trained on the project's own sample reviews. Nothing is downloaded.
// Variables are made one at a time as they are written (random_variable), never the whole model,
// so a real shape (gemma_7b_en in bfloat16: 17 GB) is written in a few GB of memory.
#include <filesystem>
#include <iostream>

#include "cli/commands.h"

#include "core/error.h"
#include "data/sample_reviews.h"
#include "model/init.h"
#include "store/save.h"
#include "text/tokenizer.h"

namespace meshtune::cli {

Runner add_init_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("init", "Create the embedded tiny model (a random Gemma with its own tokenizer)");
  struct Options {
    std::string out, config = "tiny", format = "keras", dtype = "float32";
    uint64_t seed = 0;
    int vocab_size = 512;
    int sequence_length = 64;
    int layers = 0;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("out", o->out, "Directory to write")->required();
  cmd->add_option("--config", o->config,
                  "tiny (Gemma 1), tiny-gemma2, tiny-gemma3, or a KerasHub preset name with its real shape: "
                  "gemma_2b_en, gemma_7b_en, gemma2_2b_en, gemma2_9b_en, gemma2_27b_en, gemma3_270m, gemma3_1b, "
                  "gemma3_4b, gemma3_12b, gemma3_27b (random weights; the tokenizer still has --vocab-size pieces)");
  cmd->add_option("--layers", o->layers, "Number of decoder blocks (default: the config's)")->check(CLI::PositiveNumber);
  cmd->add_option("--format", o->format, "keras (preset directory, default) or hf (safetensors checkpoint)")
      ->check(CLI::IsMember({"keras", "hf"}));
  cmd->add_option("--dtype", o->dtype, "float32 (default) or bfloat16: the dtype of the weight matrices (norm scales "
                                      "stay float32)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  cmd->add_option("--seed", o->seed, "Seed for the random weights (default 0)");
  cmd->add_option("--vocab-size", o->vocab_size, "Tokenizer vocabulary size (default 512)")->check(CLI::Range(300, 4000));
  cmd->add_option("--sequence-length", o->sequence_length, "preprocessor.json sequence_length (default 64)");
  return [o] {
    namespace fs = std::filesystem;
    check(o->sequence_length >= 1 && o->sequence_length <= kMaxPositions, "--sequence-length must be in [1, ",
          kMaxPositions, "], got ", o->sequence_length);
    fs::create_directories(o->out);
    const std::string tokenizer_path = (fs::path(o->out) / "tokenizer.tmp.spm").string();
    struct RemoveOnExit {  // the trained tokenizer is copied into the preset; never left behind
      std::string path;
      ~RemoveOnExit() { std::error_code ec; fs::remove(path, ec); }
    } remove_tokenizer{tokenizer_path};
    train_tokenizer(sample_reviews(), o->vocab_size, tokenizer_path);
    Tokenizer tokenizer(tokenizer_path);
    const bool tiny = o->config.rfind("tiny", 0) == 0;  // the test shapes take the tokenizer's vocabulary
    GemmaConfig config = preset_config(o->config, tiny ? tokenizer.vocab_size() : 0);
    if (o->layers > 0) config.num_layers = o->layers;
    // random_model's weights, each made just before it is written.
    const DType dtype = o->dtype == "bfloat16" ? DType::BF16 : DType::F32;
    const VariableSource variables{
        [dtype](const VariableSpec& spec) { return random_variable_dtype(spec, dtype); },
        [seed = o->seed, dtype](const VariableSpec& spec) { return random_variable(spec, seed, dtype); }};
    if (o->format == "keras") save_keras_preset(config, variables, tokenizer_path, o->sequence_length, o->out);
    else save_hf_checkpoint(config, variables, tokenizer_path, o->out);
    std::cerr << "wrote " << o->config << " model (" << config.num_parameters() << " parameters, " << o->dtype
              << ", vocabulary " << tokenizer.vocab_size() << ") to " << o->out << "\n";
    return 0;
  };
}

}  // namespace meshtune::cli
