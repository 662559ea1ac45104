#include "dist/sharding.h"

#include "core/error.h"

namespace meshtune {

// Our 3-D dimension that holds each Keras dimension (see keras_to_ours in model/variables.cpp).
static std::vector<int> our_dims(VarKind kind, bool identity, size_t keras_rank) {
  if (identity) {  // right-aligned: rank-1 → {2}, rank-2 → {1, 2}, rank-3 → {0, 1, 2}
    std::vector<int> dims;
    for (size_t i = 0; i < keras_rank; ++i) dims.push_back(int(3 - keras_rank + i));
    return dims;
  }
  switch (kind) {
    case VarKind::Embedding: return {1, 2};     // (V, D) → (1, V, D)
    case VarKind::Norm: return {2};             // (D,) → (1, 1, D)
    case VarKind::HeadsIn: return {0, 2, 1};    // (n, d, h) → (n, h, d)
    case VarKind::HeadsOut: return {1, 2, 0};   // (n, h, d) → (d, n, h)
    case VarKind::Dense: return {2, 1};         // (in, out) → (1, out, in)
  }
  return {};
}

ShardSpec make_shard_spec(VarKind kind, bool identity, const Shape& keras_shape, const PartitionSpec& spec,
                          DeviceMesh& mesh) {
  ShardSpec s;
  const std::vector<int> dims = our_dims(kind, identity, keras_shape.size());
  check(dims.size() == keras_shape.size() && spec.size() == keras_shape.size(), "sharding: rank mismatch");
  for (size_t k = 0; k < keras_shape.size(); ++k) s.full[size_t(dims[k])] = keras_shape[k];
  s.local = s.full;
  for (size_t k = 0; k < spec.size(); ++k) {
    if (!spec[k]) continue;
    const int axis = mesh.axis_index(*spec[k]);
    check(axis >= 0, "sharding: unknown mesh axis ", *spec[k]);
    const int d = dims[k];
    const int parts = mesh.axis_size(axis);
    check(s.full[size_t(d)] % parts == 0, "sharding: dimension not divisible");
    s.axis[size_t(d)] = axis;
    s.local[size_t(d)] = s.full[size_t(d)] / parts;
    s.offset[size_t(d)] = s.local[size_t(d)] * mesh.coordinate(axis);
  }
  return s;
}

std::vector<float> take_block(const float* full, const ShardSpec& s) {
  std::vector<float> block(static_cast<size_t>(s.local_size()));
  size_t o = 0;
  for (int64_t a = 0; a < s.local[0]; ++a)
    for (int64_t b = 0; b < s.local[1]; ++b) {
      const float* row = full + ((a + s.offset[0]) * s.full[1] + (b + s.offset[1])) * s.full[2] + s.offset[2];
      std::copy(row, row + s.local[2], block.begin() + long(o));
      o += size_t(s.local[2]);
    }
  return block;
}

void gather_full(const float* block, const ShardSpec& s, DeviceMesh& mesh, float* full) {
  // Grow the block one split dimension at a time: all-gather along that dimension's axis (members
  // come in coordinate order), then interleave the members' blocks along the dimension.
  std::array<int64_t, 3> cur = s.local;
  std::vector<float> current(block, block + s.local_size());
  for (int d = 0; d < 3; ++d) {
    if (s.axis[size_t(d)] < 0) continue;
    Communicator& comm = mesh.axis_comm(s.axis[size_t(d)]);
    const int parts = comm.size();
    const size_t count = current.size();
    std::vector<float> gathered(count * size_t(parts));
    comm.all_gather(current.data(), count, gathered.data());
    std::array<int64_t, 3> next = cur;
    next[size_t(d)] *= parts;
    std::vector<float> grown(count * size_t(parts));
    for (int m = 0; m < parts; ++m)
      for (int64_t a = 0; a < cur[0]; ++a)
        for (int64_t b = 0; b < cur[1]; ++b) {
          std::array<int64_t, 2> at = {a, b};
          const float* src = gathered.data() + size_t(m) * count + size_t((a * cur[1] + b) * cur[2]);
          int64_t na = at[0], nb = at[1], nc = 0;
          if (d == 0) na += m * cur[0];
          if (d == 1) nb += m * cur[1];
          if (d == 2) nc = m * cur[2];
          std::copy(src, src + cur[2], grown.begin() + long((na * next[1] + nb) * next[2] + nc));
        }
    current.swap(grown);
    cur = next;
  }
  std::copy(current.begin(), current.end(), full);
}

}  // namespace meshtune
