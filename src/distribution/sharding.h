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

#include "distribution/layout.h"
#include "distribution/mesh.h"

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

// Which of the 3-D dimensions holds each dimension of a tensor as its layout (PartitionSpec) names
// them: the model layer knows how its variables are stored (model/variables.h our_dimensions);
// a tensor stored as it is named maps right-aligned (rank 1 → {2}, rank 2 → {1, 2}, rank 3 → {0, 1, 2}).
using DimensionMap = std::vector<int>;
DimensionMap right_aligned_dimensions(size_t rank);

// This process' block of a tensor of `shape` (as named) placed by `spec` on `mesh`.
ShardSpec make_shard_spec(const DimensionMap& dims, const Shape& shape, const PartitionSpec& spec, DeviceMesh& mesh);

// The whole tensor as a spec (nothing split), and narrowing dimension `dim` of a spec to
// [offset, offset + length) as split over mesh axis `axis` (tensor parallelism's compute regions).
ShardSpec whole_shard_spec(const DimensionMap& dims, const Shape& shape);
void narrow(ShardSpec& s, int dim, int axis, int64_t offset, int64_t length);
bool contains(const ShardSpec& outer, const ShardSpec& inner);  // inner's region lies inside outer's
bool same_region(const ShardSpec& a, const ShardSpec& b);
bool overlaps(const ShardSpec& a, const ShardSpec& b);  // the regions share at least one value
// `inner`'s block seen inside `outer`'s block (outer ⊇ inner): full = outer's block, and only the
// dimensions where inner is smaller stay split (by inner's axes).
ShardSpec relative(const ShardSpec& inner, const ShardSpec& outer);

std::vector<float> take_block(const float* full, const ShardSpec& s);
void take_block(const float* full, const ShardSpec& s, float* block);  // into local_size() floats at `block`
// The inverse of take_block: writes the block into its place in `full` (other values untouched).
void place_block(const float* block, const ShardSpec& s, float* full);
// `full` receives the whole variable (full_size() floats) on every process.
void gather_full(const float* block, const ShardSpec& s, DeviceMesh& mesh, float* full);
// The values of `region` (a spec's block, e.g. a tensor-parallel compute region) on every process,
// from its `storage` block: an all-gather over the storage's own split axes when the region
// contains the storage block, else the whole variable is gathered and the region cut from it.
std::vector<float> gather_region(const float* block, const ShardSpec& storage, const ShardSpec& region,
                                 DeviceMesh& mesh);

}  // namespace meshtune
