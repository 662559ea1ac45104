// Finding and loading a model directory: a Keras preset (config.json + model.weights.h5 or its
// sharded index + assets/tokenizer/vocabulary.spm) or a Hugging Face checkpoint (config.json with a
// model_type + model.safetensors or its index + tokenizer.model). The format is detected from the
// files present, never guessed silently.
#pragma once
#include <string>

#include "distribution/sharding.h"
#include "io/keras_h5.h"
#include "model/gemma.h"

namespace meshtune {

enum class ModelFormat { Keras, HuggingFace };

struct ModelDir {
  std::string path;            // the directory
  ModelFormat format = ModelFormat::Keras;
  std::string config_path;     // config.json
  std::string tokenizer_path;  // vocabulary.spm / tokenizer.model ("" if absent)
  int sequence_length = 1024;  // preprocessor.json's, else KerasHub's default 1024
};

// Resolves MODEL to a directory: an existing path is used as it is; a bare preset name
// ("gemma_2b_en") is looked up in `models_dir` (if given), then in each entry of the
// MESHTUNE_MODELS environment variable (colon-separated). Throws Error listing where it looked.
std::string resolve_model_path(const std::string& model, const std::string& models_dir = "");

// Detects the format and reads the config. Throws Error naming the directory/file.
ModelDir inspect_model_dir(const std::string& dir);

// How load_model stores the matrices.
struct LoadOptions {
  // Keep bf16-stored matrices as bf16 (converted inside the kernels); false widens them to fp32.
  bool keep_bf16 = true;
  // Store every float matrix as bf16 (fp32 ones rounded to nearest even): frozen weights under a
  // bf16 dtype policy.
  bool bf16_matrices = false;
  // Quantize every float matrix (the 7 projections of each block and the tied embedding) to int8
  // as it is loaded, with Keras' formula (backend/cpu/int8.h), so the float copy never exists whole.
  bool quantize_int8 = false;
  // Sharded loading (under a mesh): `block_of` names the block (in our 3-D view) of each variable
  // this process needs only a block of. A Keras preset reads just that box from the file (HDF5
  // hyperslab), and the variable then holds only its block (in our layout) — which ShardedModel
  // recognises by its size. Safetensors are memory-mapped, so a process only touches the pages of
  // the rows it uses; with quantize_int8 or bf16_matrices their blocks are cut out and converted
  // one by one too.
  std::function<std::optional<ShardSpec>(const VariableSpec& spec)> block_of;
  // With quantize_int8 and block_of: turns a block's row maxima into the whole rows' maxima (for
  // a block of some columns, an all-reduce-max with the processes holding the others:
  // model/sharded_model.h combine_row_maxima), so every block has the whole matrix's codes and
  // scales, as Keras quantizes the whole kernel. Called for every quantized block, in variable
  // order, on every process.
  std::function<void(const VariableSpec& spec, const ShardSpec& block, float* row_max)> combine_row_max;
};

// Loads config and weights. fp32 safetensors are memory-mapped and used in place. A Keras int8
// preset (a DTypePolicyMap in config.json, int8.md §4) loads as int8 codes with their scales.
// Every tensor's presence, dtype and shape are checked against the config; errors name the file
// and the tensor.
GemmaModel load_model(const ModelDir& dir, const LoadOptions& options = {});
// The config alone (to plan a layout before loading).
GemmaConfig read_model_config(const ModelDir& dir);

}  // namespace meshtune
