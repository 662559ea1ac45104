#include "cli/loading.h"

#include <chrono>
#include <iostream>

#include "core/error.h"
#include "distribution/communicator.h"
#include "kernels/linear.h"
#include "model/variables.h"
#include "store/lora_files.h"

namespace meshtune::cli {

GemmaConfig read_config(const ModelOptions& options) {
  return read_model_config(inspect_model_dir(resolve_model_path(options.model, options.models_dir)));
}

LoadedModel load_model_and_tokenizer(const ModelOptions& options, bool need_tokenizer, const LoadOptions& sharded) {
  LoadedModel loaded;
  loaded.dir = inspect_model_dir(resolve_model_path(options.model, options.models_dir));
  auto t0 = std::chrono::steady_clock::now();
  LoadOptions load;
  load.keep_bf16 = !options.fp32_weights;
  load.quantize_int8 = options.quantize == "int8";
  // Under a bf16 policy, matrices that are not trained are stored in bf16 once: the same values
  // Keras' per-call cast gives, at half the memory.
  const bool bf16_policy = options.dtype_policy != "float32";
  load.bf16_matrices = bf16_policy && !options.trains_weights;
  // Reads MESHTUNE_BF16_MATMUL now, so that a bad value is an error even where every product would
  // take the few-row path that never asks.
  if (bf16_policy) bf16_matmul_uses_dot_products();
  if (options.lora.empty()) {
    load.block_of = sharded.block_of;
    load.combine_row_max = sharded.combine_row_max;
  }
  loaded.model = load_model(loaded.dir, load);
  if (bf16_policy) loaded.model.matmul_precision = MatmulPrecision::BF16;
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bool main_process = world().rank() == 0;  // one log line per job, not per rank
  if (main_process) std::cerr << "loaded " << loaded.dir.path << " ("
            << (loaded.dir.format == ModelFormat::Keras ? "Keras preset" : "Hugging Face checkpoint") << ", Gemma "
            << loaded.model.config.family << ", " << loaded.model.config.num_parameters() << " parameters) in "
            << seconds << " s\n";
  if (!options.lora.empty()) {
    loaded.lora = std::make_unique<LoraWeights>(load_lora_adapter(options.lora, loaded.model.config));
    const LoraWeights& lora = *loaded.lora;
    // Over int8 weights the adapter stays a low-rank term (Keras does not merge either: merging
    // would need a float copy of W and re-quantizing changes the numbers, int8.md §5).
    const bool low_rank = loaded.model.has_int8();
    if (main_process) std::cerr << (low_rank ? "attached" : "merged") << " LoRA adapter " << options.lora << " (rank "
              << lora.rank << ", " << lora.num_parameters() << " parameters)\n";
    if (low_rank) {
      attach_lora(loaded.model, *loaded.lora, loaded.model.config);
    } else {
      loaded.model = merge_lora(loaded.model, lora);
      loaded.lora.reset();  // merged: nothing to keep
      if (load.bf16_matrices)  // the merged matrices are fp32: store them as bf16 too
        for (const VariableSpec& spec : gemma_variables(loaded.model.config))
          if (WeightMatrix* w = loaded.model.matrix(spec.slot, spec.layer)) *w = to_bf16_matrix(*w);
    }
  }
  if (need_tokenizer) {
    check(!loaded.dir.tokenizer_path.empty(), loaded.dir.path, ": no tokenizer (",
          loaded.dir.format == ModelFormat::Keras ? "assets/tokenizer/vocabulary.spm" : "tokenizer.model", ")");
    loaded.tokenizer = std::make_unique<Tokenizer>(loaded.dir.tokenizer_path);
    check(loaded.tokenizer->vocab_size() <= loaded.model.config.vocab_size, loaded.dir.tokenizer_path,
          ": the tokenizer has ", loaded.tokenizer->vocab_size(), " pieces but ", loaded.dir.config_path,
          " says vocabulary_size ", loaded.model.config.vocab_size, ": its ids would not fit the embedding");
  }
  return loaded;
}

}  // namespace meshtune::cli
