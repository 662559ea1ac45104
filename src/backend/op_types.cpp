#include "backend/op_types.h"

#include <cmath>

namespace meshtune {

void softmax_combine_max(const float* gathered, int parts, int64_t n, SoftmaxRows& rows) {
  for (int64_t i = 0; i < n; ++i)
    for (int r = 0; r < parts; ++r) {
      const float value = gathered[(2 * r) * n + i], index = gathered[(2 * r + 1) * n + i];
      if (r == 0 || value > rows.max[size_t(i)]) rows.max[size_t(i)] = value, rows.argmax[size_t(i)] = index;
    }
}

void softmax_cross_entropy_sums(const SoftmaxRows& stats, const int32_t* targets, const float* weights,
                                const int64_t* rows, int64_t n, double sums[3]) {
  for (int64_t i = 0; i < n; ++i) {
    const double w = weights[rows[i]];
    const double ce = std::log(stats.sum_exp_and_target[size_t(i)]) + double(stats.max[size_t(i)]) -
                      double(float(stats.sum_exp_and_target[size_t(n + i)]));
    sums[0] += w * ce;
    sums[1] += w * (int64_t(stats.argmax[size_t(i)]) == targets[rows[i]] ? 1.0 : 0.0);
    sums[2] += w;
  }
}

}  // namespace meshtune
