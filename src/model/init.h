// Randomly initialised models: the embedded tiny default (`meshtune init`), test models, and the
// Gemma-2B-shaped benchmark model. Deterministic for a given seed on every machine.
#pragma once
#include <cstdint>
#include <string>

#include "model/gemma.h"

namespace meshtune {

// Named small configs: "tiny" (Gemma 1), "tiny-gemma2", "tiny-gemma3": hidden 64, 2 layers (6 for
// tiny-gemma3, so it has a global layer), 4 query heads, head_dim 16, FFN width 128; "gemma-2b":
// Gemma 2B's shape (18 layers, hidden 2048, 8 query heads sharing 1 KV head of 256, FFN 16384).
GemmaConfig named_config(const std::string& name, int vocab_size);

// Weights ~ N(0, 1/fan_in) for kernels, N(0, 1/D) for the embedding, small random norm scales.
// `dtype` F32 or BF16 for the matrices.
GemmaModel random_model(const GemmaConfig& config, uint64_t seed, DType dtype = DType::F32);

}  // namespace meshtune
