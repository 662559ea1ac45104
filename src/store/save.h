// Writing a model back out: as a Keras preset directory (what `save_to_preset` writes, spec §3)
// or as a Hugging Face checkpoint (config.json + model.safetensors + tokenizer.model, spec §4/§11).
// Every file is written atomically (temp file, fsync, rename).
#pragma once
#include <string>

#include "model/gemma.h"

namespace meshtune {

// `tokenizer_path` is copied to assets/tokenizer/vocabulary.spm; `sequence_length` goes into
// preprocessor.json. Weights are stored in their in-memory dtype (fp32 or bf16).
void save_keras_preset(const GemmaModel& model, const std::string& tokenizer_path, int sequence_length,
                       const std::string& out_dir);

void save_hf_checkpoint(const GemmaModel& model, const std::string& tokenizer_path, const std::string& out_dir);

}  // namespace meshtune
