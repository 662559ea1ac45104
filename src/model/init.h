// Randomly initialised models of any config (model/presets.h names them): the embedded tiny
// default (`meshtune init`), test models, and the benchmarks' real shapes. Deterministic for a given seed on every machine.
#pragma once
#include <cstdint>
#include <string>

#include "model/gemma.h"
#include "model/presets.h"

namespace meshtune {

// Weights ~ N(0, 1/fan_in) for kernels, N(0, 1/D) for the embedding, small random norm scales.
// `dtype` F32 or BF16 for the matrices.
GemmaModel random_model(const GemmaConfig& config, uint64_t seed, DType dtype = DType::F32);

}  // namespace meshtune
