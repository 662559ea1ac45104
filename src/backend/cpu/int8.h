// The int8 linear layer of the CPU backend: Keras' int8 arithmetic (core/weight_matrix.h, the
// format and the weight quantization) with activations quantized per token at every call.
#pragma once
#include <cstdint>

#include "core/weight_matrix.h"
#include "backend/cpu/kernel_path.h"

namespace meshtune {

// out[r] = max|x[r, :]| over each of `rows` rows of `cols` values.
void row_abs_max(const float* x, int64_t rows, int64_t cols, float* out);

// y[M, W.rows] = x[M, W.cols]·Wᵀ for an I8 matrix: x quantized per row, exact int32 dot products,
// then dequantized. linear() calls this for I8. More than a few rows go to oneDNN's s8 matmul where
// the path says so (3.6× our kernel at prefill shapes); decode, and paths without it, use our
// kernel for the path's instruction set (backend/cpu/isa/int8_dot.h; 1.9× oneDNN at one row). Same floats.
// `x_row_max` (M values), when given, is each token's max|x| over the whole input of which x holds
// a slice (tensor parallelism's heads or FFN columns): the codes are then the whole input's.
void linear_int8(const KernelPath& path, const float* x, int64_t M, const WeightMatrix& W, float* y,
                 const float* x_row_max = nullptr);
bool int8_uses_onednn(const KernelPath& path, int64_t M);  // whether linear_int8 takes oneDNN for M rows

}  // namespace meshtune
