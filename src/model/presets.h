// Gemma variants as data (gemma.cpp's configs.cc is the model): a base config per family, and each
// named variant a few assignments on its base — the KerasHub preset names users type, with their
// real shapes (spec §1.7), and the tiny shapes the tests and the demo use.
#pragma once
#include <string>
#include <vector>

#include "model/config.h"

namespace meshtune {

GemmaConfig gemma1_base();
GemmaConfig gemma2_base();
GemmaConfig gemma3_base();

// The config named `name`: a KerasHub preset (gemma_2b_en, gemma_7b_en, gemma2_2b_en, gemma2_9b_en,
// gemma2_27b_en, gemma3_270m, gemma3_1b, gemma3_4b, gemma3_12b, gemma3_27b; "_instruct" variants
// share the shapes) or a test shape (tiny, tiny-gemma2, tiny-gemma3). `vocab_size` > 0 replaces the
// vocabulary size (the tiny shapes take their tokenizer's). Throws Error listing the names.
GemmaConfig preset_config(const std::string& name, int vocab_size = 0);
std::vector<std::string> preset_names();

}  // namespace meshtune
