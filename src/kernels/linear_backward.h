// Backward of linear (y = x·Wᵀ, W [out, in]): dx = dy·W and dW = dyᵀ·x, through OpenBLAS.
#pragma once
#include "kernels/linear.h"

namespace meshtune {

// dx[M, cols] (+)= dy[M, rows] · W. `accumulate` adds into dx instead of overwriting.
void linear_backward_input(const float* dy, int64_t M, const WeightMatrix& W, float* dx, bool accumulate = false);

// dW[rows, cols] += dy[M, rows]ᵀ · x[M, cols].
void linear_backward_weight(const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols, float* dW);

}  // namespace meshtune
