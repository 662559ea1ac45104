#include "dist/sharded_model.h"

#include "core/error.h"

namespace meshtune {

std::vector<float> variable_values(const GemmaModel& m, const VariableSpec& spec) {
  if (const WeightMatrix* w = m.matrix(spec.slot, spec.layer)) return w->to_f32();
  return *m.vector(spec.slot, spec.layer);
}

void set_variable(GemmaModel& m, const VariableSpec& spec, std::vector<float> values) {
  if (WeightMatrix* w = m.matrix(spec.slot, spec.layer)) {
    const int64_t rows = values.empty() ? 0 : spec.hf_shape[0];
    const int64_t cols = rows ? int64_t(values.size()) / rows : 0;  // before `values` is moved from
    *w = WeightMatrix::from_f32(rows, cols, std::move(values));
  } else {
    *m.vector(spec.slot, spec.layer) = std::move(values);
  }
}

// This process' block of a variable, reading only the rows the block covers: a memory-mapped
// checkpoint is only touched where this process' bytes are.
static std::vector<float> block_of(const GemmaModel& m, const VariableSpec& spec, const ShardSpec& s) {
  const WeightMatrix* w = m.matrix(spec.slot, spec.layer);
  if (!w) return take_block(m.vector(spec.slot, spec.layer)->data(), s);
  std::vector<float> block(static_cast<size_t>(s.local_size())), row(static_cast<size_t>(w->cols));
  size_t o = 0;
  for (int64_t a = 0; a < s.local[0]; ++a)
    for (int64_t b = 0; b < s.local[1]; ++b) {
      // The run of local[2] values starts at this flat index of the 3-D view, inside one matrix row.
      const int64_t flat = ((a + s.offset[0]) * s.full[1] + (b + s.offset[1])) * s.full[2] + s.offset[2];
      const int64_t r = flat / w->cols, c0 = flat % w->cols;
      if (w->dtype == DType::F32) {
        const float* src = w->f32() + r * w->cols + c0;
        std::copy(src, src + s.local[2], block.begin() + long(o));
      } else {
        for (int64_t c = 0; c < s.local[2]; ++c) block[o + size_t(c)] = w->at(r, c0 + c);
      }
      o += size_t(s.local[2]);
    }
  return block;
}

ShardedModel::ShardedModel(GemmaModel model, const LayoutMap& layout, DeviceMesh& mesh)
    : model_(std::move(model)), mesh_(&mesh) {
  for (const VariableSpec& spec : gemma_variables(model_.config)) {
    ShardSpec shard = make_shard_spec(spec.kind, false, spec.keras_shape,
                                      layout.resolve(spec.keras_path, spec.keras_shape, mesh), mesh);
    if (!shard.split()) continue;
    blocks_.push_back({spec, shard, block_of(model_, spec, shard)});
    set_variable(model_, spec, {});  // keep only the block
  }
}

GemmaModel ShardedModel::materialize() const {
  GemmaModel m = model_;
  for (const Block& b : blocks_) {
    std::vector<float> full(static_cast<size_t>(b.shard.full_size()));
    gather_full(b.values.data(), b.shard, *mesh_, full.data());
    set_variable(m, b.spec, std::move(full));
  }
  return m;
}

GemmaModel ShardedModel::materialize_by_layer() const {
  GemmaModel m = model_;
  for (const Block& b : blocks_) {
    if (b.spec.layer >= 0) continue;  // embeddings and the final norm: whole for the whole step
    std::vector<float> full(static_cast<size_t>(b.shard.full_size()));
    gather_full(b.values.data(), b.shard, *mesh_, full.data());
    set_variable(m, b.spec, std::move(full));
  }
  m.layer_source = [this](int layer) {
    DecoderLayerWeights w = model_.layers[size_t(layer)];
    for (const Block& b : blocks_) {
      if (b.spec.layer != layer) continue;
      std::vector<float> full(static_cast<size_t>(b.shard.full_size()));
      gather_full(b.values.data(), b.shard, *mesh_, full.data());
      if (WeightMatrix* matrix = w.matrix(b.spec.slot)) {
        *matrix = WeightMatrix::from_f32(b.spec.hf_shape[0], b.shard.full_size() / b.spec.hf_shape[0], std::move(full));
      } else {
        *w.vector(b.spec.slot) = std::move(full);
      }
    }
    return w;
  };
  return m;
}

size_t ShardedModel::held_bytes() const {
  size_t bytes = model_.weight_bytes();
  for (const Block& b : blocks_) bytes += b.values.size() * 4;
  return bytes;
}

}  // namespace meshtune
