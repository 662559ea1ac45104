#include "dist/sharded_model.h"

#include "core/error.h"

namespace meshtune {

// The matrix or vector behind a variable.
static const WeightMatrix* matrix_of(const GemmaModel& m, const VariableSpec& spec) {
  const DecoderLayerWeights* l = spec.layer >= 0 ? &m.layers[size_t(spec.layer)] : nullptr;
  switch (spec.slot) {
    case Slot::Embeddings: return &m.embeddings;
    case Slot::Query: return &l->query;
    case Slot::Key: return &l->key;
    case Slot::Value: return &l->value;
    case Slot::AttentionOutput: return &l->attention_output;
    case Slot::FfwGating: return &l->ffw_gating;
    case Slot::FfwGating2: return &l->ffw_gating_2;
    case Slot::FfwLinear: return &l->ffw_linear;
    default: return nullptr;
  }
}

static const std::vector<float>* vector_of(const GemmaModel& m, const VariableSpec& spec) {
  const DecoderLayerWeights* l = spec.layer >= 0 ? &m.layers[size_t(spec.layer)] : nullptr;
  switch (spec.slot) {
    case Slot::FinalNorm: return &m.final_norm;
    case Slot::PreAttentionNorm: return &l->pre_attention_norm;
    case Slot::PostAttentionNorm: return &l->post_attention_norm;
    case Slot::PreFfwNorm: return &l->pre_ffw_norm;
    case Slot::PostFfwNorm: return &l->post_ffw_norm;
    case Slot::QueryNorm: return &l->query_norm;
    case Slot::KeyNorm: return &l->key_norm;
    default: return nullptr;
  }
}

std::vector<float> variable_values(const GemmaModel& m, const VariableSpec& spec) {
  if (const WeightMatrix* w = matrix_of(m, spec)) {
    std::vector<float> out(static_cast<size_t>(w->rows * w->cols));
    for (int64_t r = 0; r < w->rows; ++r) w->row_to_f32(r, out.data() + r * w->cols);
    return out;
  }
  return *vector_of(m, spec);
}

void set_variable(GemmaModel& m, const VariableSpec& spec, std::vector<float> values) {
  if (const WeightMatrix* found = matrix_of(m, spec)) {
    WeightMatrix& w = const_cast<WeightMatrix&>(*found);
    auto data = std::make_shared<std::vector<float>>(std::move(values));
    w.dtype = DType::F32;
    w.rows = data->empty() ? 0 : spec.hf_shape[0];
    w.cols = data->empty() ? 0 : num_elements(spec.hf_shape) / spec.hf_shape[0];
    w.data = data->data();
    w.owner = data;
    return;
  }
  const_cast<std::vector<float>&>(*vector_of(m, spec)) = std::move(values);
}

// This process' block of a variable, reading only the rows the block covers: a memory-mapped
// checkpoint is only touched where this process' bytes are.
static std::vector<float> block_of(const GemmaModel& m, const VariableSpec& spec, const ShardSpec& s) {
  const WeightMatrix* w = matrix_of(m, spec);
  if (!w) return take_block(vector_of(m, spec)->data(), s);
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

size_t ShardedModel::held_bytes() const {
  size_t bytes = model_.weight_bytes();
  for (const Block& b : blocks_) bytes += b.values.size() * 4;
  return bytes;
}

}  // namespace meshtune
