// The integer core of the int8 linear layer (kernels/int8.h): exact int32 dot products of int8
// activation codes with int8 weight rows, one file per instruction set like gemv.h (and under the
// same rule: no standard-library templates, no inline functions from other headers).
#pragma once
#include <cstdint>

namespace meshtune::cpu {

// acc[m·rows + r] = Σ_c x[m·cols + c]·w[r·cols + c] in int32, for m < M, r < rows. Exact: |code| ≤
// 127, so any cols below 133,000 fits. Threaded over rows; each block of weight rows is loaded once
// and used for every row of x.
void dot_int8_generic(const int8_t* x, int64_t M, const int8_t* w, int64_t rows, int64_t cols, int32_t* acc);
void dot_int8_avx2(const int8_t* x, int64_t M, const int8_t* w, int64_t rows, int64_t cols, int32_t* acc);
void dot_int8_avx512(const int8_t* x, int64_t M, const int8_t* w, int64_t rows, int64_t cols, int32_t* acc);

}  // namespace meshtune::cpu
