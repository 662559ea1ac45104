// Elementwise pieces of the Gemma block: tanh-approximated GELU inside GeGLU, and soft-capping.
#pragma once
#include <cmath>
#include <cstdint>

#include "backend/cpu/kernel_path.h"

namespace meshtune {

// gelu_tanh(u) = 0.5·u·(1 + tanh(√(2/π)·(u + 0.044715·u³)))  (Keras gelu(approximate=True)).
// GeGLU: out[i] = gelu_tanh(gate[i]) · up[i], n elements (out may be gate).
void geglu(const KernelPath& path, const float* gate, const float* up, int64_t n, float* out);

// Soft-cap: x = tanh(x / cap) · cap, in place (Gemma 2 attention logits and final logits).
void soft_cap(float* x, int64_t n, float cap);

}  // namespace meshtune

namespace meshtune {

// Backward of geglu: out = gelu_tanh(gate)·up. Given the pre-activation gate and up and dout,
// writes dgate and dup (n elements each).
void geglu_backward(const KernelPath& path, const float* gate, const float* up, const float* dout, int64_t n, float* dgate, float* dup);

// Backward of soft_cap given its output y = tanh(x/cap)·cap: dx = dy·(1 − (y/cap)²), in place on dy.
void soft_cap_backward(const float* y, float* dy, int64_t n, float cap);

}  // namespace meshtune
