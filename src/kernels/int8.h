// int8 as Keras' `quantize("int8")` defines it (../shared/fixtures/keras2/int8.md, the contract):
// abs-max codes with one fp32 scale per row, s = 127 / (max|v| + 1e-7), code = clip(round half to
// even(v·s), −127, 127). Weights are quantized once per output channel (a row of our [out, in]
// layout); activations per token at every call; y = int32(x_codes · W_codesᵀ) / (s_x · s_W), one
// float division. Every step is bit-identical to Keras' numpy arithmetic.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/linear.h"

namespace meshtune {

// codes[0:n] of values[0:n]; returns their scale s (value ≈ code / s).
float quantize_int8(const float* values, int64_t n, int8_t* codes);
// The same with the scale given: when `values` are a slice of a longer row, the scale is the
// whole row's (int8_scale of its max|v|), and the codes are the whole row's codes of this slice.
void quantize_int8_scaled(const float* values, int64_t n, float scale, int8_t* codes);
// Keras' scale for a row whose largest magnitude is `abs_max`: 127 / (abs_max + 1e-7), in float32.
float int8_scale(float abs_max);
// out[r] = max|x[r, :]| over each of `rows` rows of `cols` values.
void row_abs_max(const float* x, int64_t rows, int64_t cols, float* out);
// out[c] = code[c] / scale (Keras' dequantization, a division).
void dequantize_int8(const int8_t* codes, int64_t n, float scale, float* out);

// The widest row whose int32 sum of code products cannot overflow: 127² · cols < 2³¹.
inline constexpr int64_t kMaxInt8Columns = 133144;
// Throws Error naming `what` when an int8 matrix would be wider than that.
void check_int8_columns(int64_t cols, const std::string& what);

// W (any dtype, read as fp32) quantized row by row: an I8 matrix owning its codes and scales.
// `row_max` (W.rows values), when given, is each row's max|v| over the whole row of which W holds
// some columns (a block split along the contraction, tensor parallelism); else W's own.
WeightMatrix quantize_matrix_int8(const WeightMatrix& W, const float* row_max = nullptr);
std::vector<float> matrix_row_abs_max(const WeightMatrix& W);  // max|W[r, :]| for every row

// y[M, W.rows] = x[M, W.cols]·Wᵀ for an I8 matrix: x quantized per row, exact int32 dot products,
// then dequantized. linear() calls this for I8. More than a few rows go to oneDNN's s8 matmul where
// the build has it (3.6× our kernel at prefill shapes); decode, and builds without it, use our
// kernel for the CPU path in use (kernels/cpu/int8_dot.h; 1.9× oneDNN at one row). Same floats.
// `x_row_max` (M values), when given, is each token's max|x| over the whole input of which x holds
// a slice (tensor parallelism's heads or FFN columns): the codes are then the whole input's.
void linear_int8(const float* x, int64_t M, const WeightMatrix& W, float* y, const float* x_row_max = nullptr);
// Tests switch oneDNN off to hold our own kernels to the reference at every row count.
void use_onednn_for_int8(bool use);
bool int8_uses_onednn(int64_t M);  // whether linear_int8 takes oneDNN for M rows

}  // namespace meshtune
