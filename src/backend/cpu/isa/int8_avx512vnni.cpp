// AVX-512 int8 dot products with AVX512_VNNI's vpdpwssd (int8_avx512_body.h).
#include "backend/cpu/isa/int8_avx512_body.h"

namespace meshtune::cpu {

void dot_int8_avx512vnni(const int8_t* x, int64_t M, const float* x_scales, const int8_t* w, const float* w_scales,
                         int64_t rows, int64_t cols, float* y) {
  dot_int8<true>(x, M, x_scales, w, w_scales, rows, cols, y);
}

}  // namespace meshtune::cpu
