// The AdamW update of one variable (train/optimizer.h computes the scalars; spec §8). Every
// operation is rounded separately, in Keras' order, on every CPU path, so the result is the same bit
// for bit whatever instruction set runs it.
#pragma once
#include <cstdint>

#include "backend/op_types.h"
#include "backend/cpu/kernel_path.h"

namespace meshtune {


// For i < n: θ ← θ − (θ·wd)·lr (when decaying); m ← m + (g − m)(1 − β₁); v ← v + (g² − v)(1 − β₂);
// θ ← θ − (m·α)/(√v + ε).
void adamw_update(const KernelPath& path, float* theta, const float* grad, float* m, float* v, int64_t n, const AdamWStep& step);

}  // namespace meshtune
