// The portable int8 dot products: plain loops the compiler vectorises for the build's baseline.
#include <omp.h>

#include "backend/cpu/isa/gemv.h"
#include "backend/cpu/isa/int8_dot.h"

namespace meshtune::cpu {

void dot_int8_generic(const int8_t* x, int64_t M, const float* x_scales, const int8_t* w, const float* w_scales,
                      int64_t rows, int64_t cols, float* y) {
#pragma omp parallel
  {
    int64_t r0, r1;
    thread_share(rows, omp_get_thread_num(), omp_get_num_threads(), r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* wr = w + r * cols;
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xm = x + m * cols;
        int32_t s = 0;
        for (int64_t c = 0; c < cols; ++c) s += int32_t(xm[c]) * int32_t(wr[c]);
        y[m * rows + r] = float(s) / (x_scales[m] * w_scales[r]);
      }
    }
  }
}

}  // namespace meshtune::cpu
