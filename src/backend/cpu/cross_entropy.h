// Softmax cross-entropy over the vocabulary for a chunk of rows of logits, forward and backward
// side by side, in steps that let the vocabulary be split over processes (Megatron's
// vocabulary-parallel cross-entropy): each process holds columns v0 … v0+cols−1 of every row, and
// the caller combines the per-row statistics between the steps — the maximum and its index
// (softmax_combine_max over an all-gather), then Σexp and the target's logit (an all-reduce sum).
// One process: call the steps in a row with nothing in between.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/op_types.h"
#include "backend/cpu/kernel_path.h"

namespace meshtune {


// Row i of the chunk has target targets[i] and weight weights[i]; max_and_argmax and
// sum_exp_and_target are SoftmaxRows' [2n] statistics (backend/op_types.h).
// Step 1: each row's largest logit and its index v0 + j (an index as float: vocabularies < 2^24).
void softmax_row_max(const float* z, int64_t n, int64_t cols, int64_t v0, float* max_and_argmax);
// Step 2: Σ exp(z − max) (in fp64) and the target's logit where the target is one of these columns.
void softmax_row_sums(const KernelPath& path, const float* z, int64_t n, int64_t cols, int64_t v0,
                      const int32_t* targets, const float* max_and_argmax, double* sum_exp_and_target);

// Backward, in place: z ← f·(softmax(z) − onehot(target))·(1 − (z/cap)²) with f = loss_scale·w —
// the gradient of f·CE with respect to the logits before a final soft cap (cap > 0; 0 = none).
void softmax_cross_entropy_backward(const KernelPath& path, float* z, int64_t n, int64_t cols, int64_t v0,
                                    const int32_t* targets, const float* weights, double loss_scale,
                                    const float* max_and_argmax, const double* sum_exp_and_target, float cap);

}  // namespace meshtune
