// The vector loops of the elementwise kernels (norms, RoPE, attention, GeGLU, the loss, AdamW), one
// set per instruction set: vector_ops_body.h compiled three times, for the baseline
// (vector_ops_generic.cpp), AVX2 + FMA and AVX-512. The kernels in backend/cpu/ keep the threading and
// the scratch memory and call these on single rows, from the set their KernelPath holds.
#pragma once
#include <cstdint>

#include "backend/op_types.h"

namespace meshtune::cpu {

// Elements per call for the kernels that split one long array over the threads.
inline constexpr int64_t kElementsPerCall = int64_t(1) << 14;

struct VectorOps {
  // Σ a·b over n, in 32 independent partial sums (the same order on every path).
  float (*dot)(const float* a, const float* b, int64_t n);
  // y += alpha·x.
  void (*axpy)(float alpha, const float* x, float* y, int64_t n);
  // One row of Gemma RMSNorm: y = x·rsqrt(mean(x²) + eps)·(1 + scale) (y may alias x).
  void (*rmsnorm_row)(const float* x, const float* scale, int64_t n, float eps, float* y);
  // Its backward: writes dx (may alias dy) and adds ∂L/∂scale into dscale unless it is null.
  void (*rmsnorm_backward_row)(const float* x, const float* scale, int64_t n, float eps, const float* dy,
                               float* dx, float* dscale);
  // gate = gelu_tanh(gate)·up, and its backward (outputs may alias inputs).
  void (*geglu)(const float* gate, const float* up, int64_t n, float* out);
  void (*geglu_backward)(const float* gate, const float* up, const float* dout, int64_t n, float* dgate,
                         float* dup);
  // RoPE on one head, v = [x1 | x2] of 2·half: x1·cos − x2·sin, x2·cos + x1·sin.
  void (*rotate_halves)(float* v, const float* cos, const float* sin, int64_t half);
  // e^x as exp_shifted computes it (within ~2 ulp; 0 below −87).
  float (*exp)(float x);
  // x = e^(x − shift) in place (0 for −∞), returning Σ x.
  float (*exp_shifted)(float* x, int64_t n, float shift);
  // Σ e^(x − shift), summed in double (x is not written).
  double (*sum_exp_shifted)(const float* x, int64_t n, float shift);
  // The softmax part of the cross-entropy gradient of one row of logits:
  // z = e^(z − shift)·scale, times 1 − (z/cap)² (of the incoming z) when cap > 0.
  void (*softmax_gradient)(float* z, int64_t n, float shift, float scale, float cap);
  // dst = src rounded to bf16 (to nearest even; NaN stays NaN), as core/tensor.h f32_to_bf16.
  void (*narrow_bf16)(const float* src, int64_t n, uint16_t* dst);
  // The AdamW update (backend/cpu/adamw.h) on n elements.
  void (*adamw)(float* theta, const float* grad, float* m, float* v, int64_t n, const AdamWStep& step);
};

const VectorOps& vector_ops_generic();
const VectorOps& vector_ops_avx2();
const VectorOps& vector_ops_avx512();

}  // namespace meshtune::cpu
