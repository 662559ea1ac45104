// Gemma RMSNorm (spec §1.3): y = x · rsqrt(mean(x²) + eps) · (1 + scale), in fp32, over the last dim.
#pragma once
#include <cstdint>

#include "backend/cpu/kernel_path.h"

namespace meshtune {

// x and y are [rows, dim] (may alias); scale is [dim], stored zero-centred.
void rmsnorm(const KernelPath& path, const float* x, const float* scale, int64_t rows, int64_t dim, float eps, float* y);

}  // namespace meshtune

namespace meshtune {

// Backward of rmsnorm: given x, scale and dy = ∂L/∂y, writes dx (may alias dy; adds into it, apart
// from dy, with `accumulate`) and adds ∂L/∂scale
// into dscale (if not null).
void rmsnorm_backward(const KernelPath& path, const float* x, const float* scale, int64_t rows, int64_t dim, float eps, const float* dy,
                      float* dx, float* dscale, bool accumulate = false);

}  // namespace meshtune
