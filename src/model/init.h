// Randomly initialised models of any config (model/presets.h names them): the embedded tiny
// default (`meshtune init`), test models, and the benchmarks' real shapes. Deterministic for a given
// seed on every machine and for any number of threads.
#pragma once
#include <cstdint>
#include <string>

#include "model/gemma.h"
#include "model/presets.h"

namespace meshtune {

// Weights ~ N(0, 1/fan_in) for kernels, N(0, 1/D) for the embedding, small random norm scales.
// `dtype` F32 or BF16 for the matrices; norm scales are always F32.
GemmaModel random_model(const GemmaConfig& config, uint64_t seed, DType dtype = DType::F32);

// One variable of random_model(config, seed, dtype), in our (= HF) layout, made alone: its values
// depend only on the seed and the variable (its layer and slot), so `meshtune init` can write a
// model far larger than memory one variable at a time and still give random_model's weights.
HostTensor random_variable(const VariableSpec& spec, uint64_t seed, DType dtype);
// The dtype random_variable gives `spec`: `dtype` for matrices, F32 for norm scales.
DType random_variable_dtype(const VariableSpec& spec, DType dtype);

}  // namespace meshtune
