#include "backend/op_types.h"

#include <cmath>

namespace meshtune {

void softmax_combine_max_rows(const float* gathered, int parts, int64_t n, float* max_and_argmax) {
  float *max = max_and_argmax, *argmax = max_and_argmax + n;
  for (int64_t i = 0; i < n; ++i)
    for (int r = 0; r < parts; ++r) {
      const float value = gathered[(2 * r) * n + i], index = gathered[(2 * r + 1) * n + i];
      if (r == 0 || value > max[i]) max[i] = value, argmax[i] = index;
    }
}

void softmax_cross_entropy_sum_rows(const float* max_and_argmax, const double* sum_exp_and_target,
                                    const int32_t* targets, const float* weights, int64_t n, double* sums) {
  const float *max = max_and_argmax, *argmax = max_and_argmax + n;
  for (int64_t i = 0; i < n; ++i) {
    const double w = weights[i];
    const double ce = std::log(sum_exp_and_target[i]) + double(max[i]) - double(float(sum_exp_and_target[n + i]));
    sums[0] += w * ce;
    sums[1] += w * (int64_t(argmax[i]) == targets[i] ? 1.0 : 0.0);
    sums[2] += w;
  }
}

void greedy_token_rows(const float* max_and_argmax, int64_t n, const uint8_t* keep, int32_t* ids) {
  for (int64_t i = 0; i < n; ++i)
    if (!keep[i]) ids[i] = int32_t(max_and_argmax[n + i]);
}

}  // namespace meshtune
