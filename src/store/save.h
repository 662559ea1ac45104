// Writing a model back out: as a Keras preset directory (what `save_to_preset` writes, spec §3)
// or as a Hugging Face checkpoint (config.json + model.safetensors + tokenizer.model, spec §4/§11).
// Every file is written atomically (temp file, fsync, rename).
#pragma once
#include <functional>
#include <string>

#include "model/gemma.h"

namespace meshtune {

// The model to save, one variable at a time, in our (= HF) layout: `tensor(spec)` is called just
// before the variable is written and released after, so a model larger than memory can be saved.
// `dtype(spec)` says beforehand what dtype `tensor(spec)` will give (headers come before the data).
// An I8 variable (a Keras int8 layer) also needs `scales(spec)`: its per-row fp32 scales [rows].
struct VariableSource {
  std::function<DType(const VariableSpec& spec)> dtype;
  std::function<HostTensor(const VariableSpec& spec)> tensor;
  std::function<HostTensor(const VariableSpec& spec)> scales = {};
};

// `tokenizer_path` is copied to assets/tokenizer/vocabulary.spm; `sequence_length` goes into
// preprocessor.json. Weights are stored in the dtype the source gives (fp32 or bf16); config.json's
// DTypePolicy names the embedding's (the matrices' dtype; norm scales may be fp32 in a bf16 model).
// int8 variables are written as Keras' quantize("int8") saves them (int8.md §4): the codes as
// vars/0, the scales as vars/1 in Keras' broadcast shape, and a DTypePolicyMap naming each int8
// layer (float32 elsewhere). A Hugging Face checkpoint has no int8 form: an Error.
void save_keras_preset(const GemmaConfig& config, const VariableSource& variables, const std::string& tokenizer_path,
                       int sequence_length, const std::string& out_dir);
void save_hf_checkpoint(const GemmaConfig& config, const VariableSource& variables, const std::string& tokenizer_path,
                        const std::string& out_dir);

// A model in memory, each weight stored in its in-memory dtype.
void save_keras_preset(const GemmaModel& model, const std::string& tokenizer_path, int sequence_length,
                       const std::string& out_dir);
void save_hf_checkpoint(const GemmaModel& model, const std::string& tokenizer_path, const std::string& out_dir);

}  // namespace meshtune
