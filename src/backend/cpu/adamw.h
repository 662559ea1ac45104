// The AdamW update of one variable, and the clipping of its gradient (train/optimizer.h computes the scalars; spec §8). Every
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

// Gradient clipping and the finiteness check (Backend::sum_of_squares … first_not_finite). The sum is
// taken over fixed blocks in double and the blocks' sums added in order, so it does not depend on
// the number of threads.
double sum_of_squares(const float* x, int64_t n);
void scale_by_ratio(float* x, int64_t n, float numerator, float denominator);
void clamp_values(float* x, int64_t n, float limit);
bool all_finite(const float* x, int64_t n);

}  // namespace meshtune
