#include "model/token_rows.h"

namespace meshtune {

std::vector<int64_t> token_positions(int64_t B, int64_t T, int64_t start) {
  std::vector<int64_t> positions(static_cast<size_t>(B * T));
  for (int64_t m = 0; m < B * T; ++m) positions[size_t(m)] = start + m % T;
  return positions;
}

int64_t first_id_outside(const int32_t* ids, int64_t n, int64_t limit) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= limit) return i;
  return -1;
}

WeightedRows weighted_rows(const int32_t* targets, const float* weights, int64_t n) {
  WeightedRows out;
  for (int64_t i = 0; i < n; ++i)
    if (weights[i] != 0.f) {
      out.rows.push_back(i);
      out.targets.push_back(targets[i]);
      out.weights.push_back(weights[i]);
    }
  return out;
}
}  // namespace meshtune
