// The portable paths (any x86-64, or any CPU): plain C++ the compiler vectorises for the build's
// baseline. Four independent partial sums per output keep the adds from waiting on each other.
#include <omp.h>

#include "core/tensor.h"
#include "backend/cpu/isa/gemv.h"

namespace meshtune::cpu {

namespace {

inline float value(const float* p) { return *p; }
inline float value(const uint16_t* p) { return bf16_to_f32(*p); }

template <typename T>
void gemv_any(const float* x, int64_t M, const T* w, int64_t rows, int64_t cols, float* y) {
#pragma omp parallel
  {
    int64_t r0, r1;
    thread_share(rows, omp_get_thread_num(), omp_get_num_threads(), r0, r1);
    for (int64_t r = r0; r < r1; ++r) {
      const T* wr = w + r * cols;
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * cols;
        float s[4] = {0, 0, 0, 0};
        int64_t c = 0;
        for (; c + 4 <= cols; c += 4)
          for (int j = 0; j < 4; ++j) s[j] += xm[c + j] * value(wr + c + j);
        for (; c < cols; ++c) s[0] += xm[c] * value(wr + c);
        y[m * rows + r] = (s[0] + s[1]) + (s[2] + s[3]);
      }
    }
  }
}

}  // namespace

void gemv_f32_generic(const float* x, int64_t M, const float* w, int64_t rows, int64_t cols, float* y, float*) {
  gemv_any(x, M, w, rows, cols, y);
}

void gemv_bf16_generic(const float* x, int64_t M, const uint16_t* w, int64_t rows, int64_t cols, float* y, float*) {
  gemv_any(x, M, w, rows, cols, y);
}

void widen_bf16_generic(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = bf16_to_f32(src[c]);
}

}  // namespace meshtune::cpu
