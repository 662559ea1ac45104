// The small host-side index arrays a step builds from its batch before handing them to the
// backend: token positions, the rows a weighted loss must look at, and the id range check.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace meshtune {

// Positions of the M = B·T tokens of a [B, T] batch placed at start … start+T−1 of every row.
std::vector<int64_t> token_positions(int64_t B, int64_t T, int64_t start);

// The first i < n with ids[i] outside [0, limit), or −1.
int64_t first_id_outside(const int32_t* ids, int64_t n, int64_t limit);

// The rows a weighted loss has to look at — the i < n with weights[i] ≠ 0 — with their targets
// and weights, in row order.
struct WeightedRows {
  std::vector<int64_t> rows;
  std::vector<int32_t> targets;
  std::vector<float> weights;
};
WeightedRows weighted_rows(const int32_t* targets, const float* weights, int64_t n);

}  // namespace meshtune
