// Loading what a subcommand needs: the model directory, its weights and its tokenizer, with the
// checks that tie them together (a tokenizer whose ids do not fit the embedding is refused).
#pragma once
#include <memory>

#include "cli/commands.h"
#include "model/lora.h"
#include "store/load.h"
#include "text/tokenizer.h"

namespace meshtune::cli {

struct LoadedModel {
  ModelDir dir;
  GemmaModel model;
  std::unique_ptr<Tokenizer> tokenizer;  // null when not asked for
  std::unique_ptr<LoraWeights> lora;     // an adapter the model uses as low-rank terms (int8 base); null once merged
};

// The model's config alone (to plan a mesh layout before the weights are read).
GemmaConfig read_config(const ModelOptions& options);

// `sharded`: sharded loading (LoadOptions::block_of and combine_row_max; see load_model), ignored
// when a LoRA adapter is merged at load.
LoadedModel load_model_and_tokenizer(const ModelOptions& options, bool need_tokenizer, const LoadOptions& sharded = {});

}  // namespace meshtune::cli
