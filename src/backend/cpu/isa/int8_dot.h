// The core of the int8 linear layer (backend/cpu/int8.h): exact int32 dot products of int8 activation
// codes with int8 weight rows, dequantized as Keras does, one file per instruction set like gemv.h
// (and under the same rule: no standard-library templates, no inline functions from other headers).
#pragma once
#include <cstdint>

namespace meshtune::cpu {

// y[m·rows + r] = float(Σ_c x[m·cols + c]·w[r·cols + c]) / (x_scales[m]·w_scales[r]) for m < M,
// r < rows: the sum in int32 (exact: |code| ≤ 127, so any cols below 133,000 fits), then one
// float product and one division. Threaded over rows; each block of weight rows is loaded once
// and used for every row of x while the next block is prefetched.
void dot_int8_generic(const int8_t* x, int64_t M, const float* x_scales, const int8_t* w, const float* w_scales,
                      int64_t rows, int64_t cols, float* y);
void dot_int8_avx2(const int8_t* x, int64_t M, const float* x_scales, const int8_t* w, const float* w_scales,
                   int64_t rows, int64_t cols, float* y);
void dot_int8_avx512(const int8_t* x, int64_t M, const float* x_scales, const int8_t* w, const float* w_scales,
                     int64_t rows, int64_t cols, float* y);
void dot_int8_avx512vnni(const int8_t* x, int64_t M, const float* x_scales, const int8_t* w, const float* w_scales,
                         int64_t rows, int64_t cols, float* y);

// The same through oneDNN: cpu/onednn.h.

}  // namespace meshtune::cpu
