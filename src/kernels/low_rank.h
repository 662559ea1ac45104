// The low-rank term of a LoRA-adapted linear layer, forward and backward side by side:
//   y[:, group g] += scale · (x · A_g) · B        (A_g: [in, r], B: [r, out_g])
// with dx, ∂A and ∂B from the small products only — W is never merged or differentiated
// (mlx-examples' lora.py: y = base(x) + scale·(x @ A) @ B). Keras' attention kernels have one A
// per head sharing B (groups = heads); PEFT and dense kernels have one group. A and B are strided
// views, so PEFT's transposed storage and a tensor-parallel part of an adapter need no copies.
#pragma once
#include <cstdint>

namespace meshtune {

struct LowRankTerm {
  int64_t rank = 0;           // r; 0 = no term
  int64_t groups = 1;         // output column blocks, each with its own A
  int64_t in = 0;             // input width (columns of x)
  int64_t out_per_group = 0;  // output columns per group; y has groups·out_per_group columns
  float scale = 1;            // alpha / r
  // A_g(i, j) = a[g·a_group + i·a_row + j·a_col], B(j, o) = b[j·b_row + o·b_col]; one stride of each is 1.
  const float* a = nullptr;
  int64_t a_group = 0, a_row = 0, a_col = 0;
  const float* b = nullptr;
  int64_t b_row = 0, b_col = 0;
  // Where backward adds ∂L/∂A and ∂L/∂B (same strides as a and b); null = frozen.
  float* grad_a = nullptr;
  float* grad_b = nullptr;

  bool active() const { return rank > 0; }
  int64_t out() const { return groups * out_per_group; }
};

// y[M, out] += scale · (x[M, in] · A_g) · B for every group.
void low_rank_forward(const float* x, int64_t M, const LowRankTerm& t, float* y);

// Given dy[M, out]: dx[M, in] += scale · (dy_g · Bᵀ) · A_gᵀ; grad_a += scale · xᵀ · (dy_g · Bᵀ);
// grad_b += scale · (x · A_g)ᵀ · dy_g (summed over groups). dx may be null (no input gradient).
void low_rank_backward(const float* x, const float* dy, int64_t M, const LowRankTerm& t, float* dx);

}  // namespace meshtune
