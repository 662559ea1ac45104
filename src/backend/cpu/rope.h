// Rotary position embedding, rotate-half convention (spec §1.5): for x = [x1 | x2] over head_dim H,
// out = x·cos θ + concat(−x2, x1)·sin θ with θ_i = pos · base^(−2i/H) / scaling, i < H/2.
// (Keras' Gemma 1/2 interleave after RoPE is a permutation of q and k alike; logits do not change,
// so we do not apply it.)
#pragma once
#include <cstdint>

#include "backend/cpu/kernel_path.h"

namespace meshtune {

// x is [tokens, heads, head_dim]; token t sits at position positions[t]. Rotates in place.
void rope(const KernelPath& path, float* x, int64_t tokens, int64_t heads, int64_t head_dim, const int64_t* positions, float base,
          float scaling);

}  // namespace meshtune

namespace meshtune {

// Backward of rope: RoPE is a rotation, so the gradient is the inverse rotation of dy (in place).
void rope_backward(const KernelPath& path, float* dx, int64_t tokens, int64_t heads, int64_t head_dim, const int64_t* positions, float base,
                   float scaling);

}  // namespace meshtune
