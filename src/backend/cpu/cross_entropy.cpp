#include "backend/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>


namespace meshtune {

void softmax_row_max(const float* z, int64_t n, int64_t cols, int64_t v0, float* max_and_argmax) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* zi = z + i * cols;
    const int64_t best = std::max_element(zi, zi + cols) - zi;
    max_and_argmax[i] = zi[best];
    max_and_argmax[n + i] = float(v0 + best);
  }
}

void softmax_row_sums(const KernelPath& path, const float* z, int64_t n, int64_t cols, int64_t v0,
                      const int32_t* targets, const float* max_and_argmax, double* sum_exp_and_target) {
  const cpu::VectorOps& ops = path.ops();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float* zi = z + i * cols;
    const int64_t y = targets[i] - v0;
    sum_exp_and_target[i] = ops.sum_exp_shifted(zi, cols, max_and_argmax[i]);
    sum_exp_and_target[n + i] = y >= 0 && y < cols ? double(zi[y]) : 0.0;
  }
}

void softmax_cross_entropy_backward(const KernelPath& path, float* z, int64_t n, int64_t cols, int64_t v0,
                                    const int32_t* targets, const float* weights, double loss_scale,
                                    const float* max_and_argmax, const double* sum_exp_and_target, float cap) {
  const cpu::VectorOps& ops = path.ops();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float* zi = z + i * cols;
    const int64_t y = targets[i] - v0;
    const float factor = float(loss_scale * weights[i]);
    const float inv_sum = float(1.0 / sum_exp_and_target[i]);
    // dz = (softmax − onehot(y))·factor, times the soft-cap slope 1 − (z/cap)² of the capped logit z.
    const bool has_target = y >= 0 && y < cols;
    const float z_target = has_target ? zi[y] : 0.f;
    ops.softmax_gradient(zi, cols, max_and_argmax[i], inv_sum * factor, cap);
    if (has_target) zi[y] -= cap > 0 ? factor * (1.f - (z_target / cap) * (z_target / cap)) : factor;
  }
}

}  // namespace meshtune
