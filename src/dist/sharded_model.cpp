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

ShardedModel::ShardedModel(GemmaModel model, const LayoutMap& layout, DeviceMesh& mesh)
    : model_(std::move(model)), mesh_(&mesh) {
  for (const VariableSpec& spec : gemma_variables(model_.config)) {
    ShardSpec shard = make_shard_spec(spec.kind, false, spec.keras_shape,
                                      layout.resolve(spec.keras_path, spec.keras_shape, mesh), mesh);
    if (!shard.split()) continue;
    std::vector<float> values = variable_values(model_, spec);
    blocks_.push_back({spec, shard, take_block(values.data(), shard)});
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
