#include "kernels/linear_backward.h"

#include <cblas.h>

#include <algorithm>
#include <vector>

namespace meshtune {

void linear_backward_input(const float* dy, int64_t M, const WeightMatrix& W, float* dx, bool accumulate) {
  const float beta = accumulate ? 1.f : 0.f;
  if (W.dtype == DType::F32) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(W.cols), int(W.rows), 1.f, dy, int(W.rows),
                W.f32(), int(W.cols), beta, dx, int(W.cols));
    return;
  }
  // bf16 weights: widen a block of rows (a slice of the contraction) at a time and accumulate.
  const int64_t block = std::max<int64_t>(64, (int64_t(1) << 22) / std::max<int64_t>(1, W.cols));
  std::vector<float> scratch(static_cast<size_t>(std::min(block, W.rows) * W.cols));
  for (int64_t r0 = 0; r0 < W.rows; r0 += block) {
    const int64_t nr = std::min(block, W.rows - r0);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < nr; ++r) W.row_to_f32(r0 + r, scratch.data() + r * W.cols);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(W.cols), int(nr), 1.f, dy + r0, int(W.rows),
                scratch.data(), int(W.cols), r0 == 0 ? beta : 1.f, dx, int(W.cols));
  }
}

void linear_backward_weight(const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols, float* dW) {
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(rows), int(cols), int(M), 1.f, dy, int(rows), x, int(cols),
              1.f, dW, int(cols));
}

}  // namespace meshtune
