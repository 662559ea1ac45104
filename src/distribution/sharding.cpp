#include "distribution/sharding.h"

#include "core/error.h"

namespace meshtune {

DimensionMap right_aligned_dimensions(size_t rank) {
  DimensionMap dims;
  for (size_t i = 0; i < rank; ++i) dims.push_back(int(3 - rank + i));
  return dims;
}

ShardSpec whole_shard_spec(const DimensionMap& dims, const Shape& keras_shape) {
  ShardSpec s;
  check(dims.size() == keras_shape.size() && keras_shape.size() <= 3, "sharding: rank mismatch");
  for (size_t k = 0; k < keras_shape.size(); ++k) s.full[size_t(dims[k])] = keras_shape[k];
  s.local = s.full;
  return s;
}

void narrow(ShardSpec& s, int dim, int axis, int64_t offset, int64_t length) {
  s.axis[size_t(dim)] = length < s.full[size_t(dim)] ? axis : -1;
  s.offset[size_t(dim)] = offset;
  s.local[size_t(dim)] = length;
}

bool contains(const ShardSpec& outer, const ShardSpec& inner) {
  for (size_t d = 0; d < 3; ++d)
    if (inner.offset[d] < outer.offset[d] || inner.offset[d] + inner.local[d] > outer.offset[d] + outer.local[d])
      return false;
  return true;
}

bool same_region(const ShardSpec& a, const ShardSpec& b) { return a.offset == b.offset && a.local == b.local; }

bool overlaps(const ShardSpec& a, const ShardSpec& b) {
  for (size_t d = 0; d < 3; ++d)
    if (a.offset[d] >= b.offset[d] + b.local[d] || b.offset[d] >= a.offset[d] + a.local[d]) return false;
  return true;
}

ShardSpec relative(const ShardSpec& inner, const ShardSpec& outer) {
  ShardSpec r;
  for (size_t d = 0; d < 3; ++d) {
    r.full[d] = outer.local[d];
    r.local[d] = inner.local[d];
    r.offset[d] = inner.offset[d] - outer.offset[d];
    r.axis[d] = inner.local[d] < outer.local[d] ? inner.axis[d] : -1;
  }
  return r;
}

ShardSpec make_shard_spec(const DimensionMap& dims, const Shape& keras_shape, const PartitionSpec& spec,
                          DeviceMesh& mesh) {
  ShardSpec s = whole_shard_spec(dims, keras_shape);
  check(spec.size() == keras_shape.size(), "sharding: rank mismatch");
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

void take_block(const float* full, const ShardSpec& s, float* block) {
  size_t o = 0;
  for (int64_t a = 0; a < s.local[0]; ++a)
    for (int64_t b = 0; b < s.local[1]; ++b) {
      const float* row = full + ((a + s.offset[0]) * s.full[1] + (b + s.offset[1])) * s.full[2] + s.offset[2];
      std::copy(row, row + s.local[2], block + o);
      o += size_t(s.local[2]);
    }
}

std::vector<float> take_block(const float* full, const ShardSpec& s) {
  std::vector<float> block(static_cast<size_t>(s.local_size()));
  take_block(full, s, block.data());
  return block;
}

void place_block(const float* block, const ShardSpec& s, float* full) {
  size_t o = 0;
  for (int64_t a = 0; a < s.local[0]; ++a)
    for (int64_t b = 0; b < s.local[1]; ++b) {
      float* row = full + ((a + s.offset[0]) * s.full[1] + (b + s.offset[1])) * s.full[2] + s.offset[2];
      std::copy(block + o, block + o + size_t(s.local[2]), row);
      o += size_t(s.local[2]);
    }
}

// Places `parts` member blocks of shape `cur` (concatenated in member order) into `out`, member m
// at offset m·cur[d] along dimension d.
static void interleave(const float* gathered, std::array<int64_t, 3> cur, int d, int parts, float* out) {
  std::array<int64_t, 3> next = cur;
  next[size_t(d)] *= parts;
  const size_t count = size_t(cur[0] * cur[1] * cur[2]);
  for (int m = 0; m < parts; ++m)
    for (int64_t a = 0; a < cur[0]; ++a)
      for (int64_t b = 0; b < cur[1]; ++b) {
        const float* src = gathered + size_t(m) * count + size_t((a * cur[1] + b) * cur[2]);
        const int64_t na = a + (d == 0 ? m * cur[0] : 0), nb = b + (d == 1 ? m * cur[1] : 0),
                      nc = d == 2 ? m * cur[2] : 0;
        std::copy(src, src + cur[2], out + (na * next[1] + nb) * next[2] + nc);
      }
}

void gather_full(const float* block, const ShardSpec& s, DeviceMesh& mesh, float* full) {
  std::vector<int> split_dims;
  for (int d = 0; d < 3; ++d)
    if (s.axis[size_t(d)] >= 0) split_dims.push_back(d);
  const size_t count = size_t(s.local_size());
  if (split_dims.empty()) {
    std::copy(block, block + count, full);
    return;
  }
  if (split_dims.size() == 1) {  // the common case: one all-gather, at most one reordering copy
    const int d = split_dims[0];
    Communicator& comm = mesh.axis_comm(s.axis[size_t(d)]);
    bool outermost = true;  // members' blocks are then consecutive in the whole variable
    for (int e = 0; e < d; ++e) outermost = outermost && s.full[size_t(e)] == 1;
    if (outermost) {
      comm.all_gather({block, count}, {full, count * size_t(comm.size())});
      return;
    }
    std::vector<float> gathered(count * size_t(comm.size()));
    comm.all_gather({block, count}, gathered);
    interleave(gathered.data(), s.local, d, comm.size(), full);
    return;
  }
  // Several split dimensions: grow the block one dimension at a time.
  std::array<int64_t, 3> cur = s.local;
  std::vector<float> current(block, block + count);
  for (int d : split_dims) {
    Communicator& comm = mesh.axis_comm(s.axis[size_t(d)]);
    std::vector<float> gathered(current.size() * size_t(comm.size())), grown(gathered.size());
    comm.all_gather(current, gathered);
    interleave(gathered.data(), cur, d, comm.size(), grown.data());
    cur[size_t(d)] *= comm.size();
    current.swap(grown);
  }
  std::copy(current.begin(), current.end(), full);
}

std::vector<float> gather_region(const float* block, const ShardSpec& storage, const ShardSpec& region,
                                 DeviceMesh& mesh) {
  if (contains(region, storage)) {
    const ShardSpec inside = relative(storage, region);
    std::vector<float> out(static_cast<size_t>(region.local_size()));
    gather_full(block, inside, mesh, out.data());
    return out;
  }
  std::vector<float> whole(static_cast<size_t>(storage.full_size()));
  gather_full(block, storage, mesh, whole.data());
  ShardSpec cut = region;
  cut.full = storage.full;
  return take_block(whole.data(), cut);
}

}  // namespace meshtune
