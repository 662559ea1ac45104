// Placing variables on a mesh: a variable's PartitionSpec (over its Keras dimensions) becomes a
// block of our in-memory layout that this process holds. Every variable is seen as 3-D
// [d0, d1, d2] in our layout; each dimension is either whole or split over one mesh axis.
// gather_full() rebuilds the whole variable with all-gathers along the splitting axes (the
// FSDP-style "all-gather before use"); take_block() cuts this process' block out of a whole one
// (after gradients are summed over the data-parallel axis: the reduce-scatter's local half).
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include "dist/layout.h"
#include "dist/mesh.h"
#include "model/variables.h"

namespace meshtune {

struct ShardSpec {
  std::array<int64_t, 3> full{1, 1, 1};    // our layout, as 3-D
  std::array<int64_t, 3> local{1, 1, 1};   // this process' block
  std::array<int64_t, 3> offset{0, 0, 0};  // where the block starts
  std::array<int, 3> axis{-1, -1, -1};     // mesh axis splitting each dimension, -1 = whole
  bool split() const { return axis[0] >= 0 || axis[1] >= 0 || axis[2] >= 0; }
  int64_t full_size() const { return full[0] * full[1] * full[2]; }
  int64_t local_size() const { return local[0] * local[1] * local[2]; }
};

// How a variable's Keras dimensions map onto our 3-D layout: a model variable of `kind`, or a
// LoRA matrix (stored in its own — Keras — layout: identity).
ShardSpec make_shard_spec(VarKind kind, bool identity_layout, const Shape& keras_shape, const PartitionSpec& spec,
                          DeviceMesh& mesh);

std::vector<float> take_block(const float* full, const ShardSpec& s);
// `full` receives the whole variable (full_size() floats) on every process.
void gather_full(const float* block, const ShardSpec& s, DeviceMesh& mesh, float* full);

}  // namespace meshtune
