// The AdamW update of one variable (train/optimizer.h computes the scalars; spec §8). Every
// operation is rounded separately, in Keras' order, on every CPU path, so the result is the same bit
// for bit whatever instruction set runs it.
#pragma once
#include <cstdint>

namespace meshtune {

// The per-step scalars, already cast to fp32 as Keras casts them.
struct AdamWStep {
  bool decay = false;       // weight decay applies to this variable
  float weight_decay = 0;   // wd
  float learning_rate = 0;  // lr
  float one_minus_beta_1 = 0, one_minus_beta_2 = 0;
  float alpha = 0;          // lr·√(1 − β₂ᵗ)/(1 − β₁ᵗ)
  float epsilon = 0;
};

// For i < n: θ ← θ − (θ·wd)·lr (when decaying); m ← m + (g − m)(1 − β₁); v ← v + (g² − v)(1 − β₂);
// θ ← θ − (m·α)/(√v + ε).
void adamw_update(float* theta, const float* grad, float* m, float* v, int64_t n, const AdamWStep& step);

}  // namespace meshtune
