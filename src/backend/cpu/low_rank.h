// The low-rank term of a LoRA-adapted linear layer, forward and backward side by side:
//   y[:, group g] += scale · (x · A_g) · B        (A_g: [in, r], B: [r, out_g])
// with dx, ∂A and ∂B from the small products only — W is never merged or differentiated
// (mlx-examples' lora.py: y = base(x) + scale·(x @ A) @ B). Keras' attention kernels have one A
// per head sharing B (groups = heads); PEFT and dense kernels have one group. A and B are strided
// views, so PEFT's transposed storage and a tensor-parallel part of an adapter need no copies.
#pragma once
#include <cstdint>

#include "backend/op_types.h"

namespace meshtune {


// y[M, out] += scale · (x[M, in] · A_g) · B for every group.
void low_rank_forward(const float* x, int64_t M, const LowRankTerm& t, float* y);

// Given dy[M, out]: dx[M, in] += scale · (dy_g · Bᵀ) · A_gᵀ; grad_a += scale · xᵀ · (dy_g · Bᵀ);
// grad_b += scale · (x · A_g)ᵀ · dy_g (summed over groups). dx may be null (no input gradient).
void low_rank_backward(const float* x, const float* dy, int64_t M, const LowRankTerm& t, float* dx);

}  // namespace meshtune
