#include "model/sharded_model.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "core/error.h"

namespace meshtune {

std::vector<float> variable_values(const GemmaModel& m, const VariableSpec& spec) {
  if (const WeightMatrix* w = m.matrix(spec.slot, spec.layer)) return w->to_f32();
  return m.vector(spec.slot, spec.layer)->to_f32();
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

int64_t block_rows(const VariableSpec& spec, const ShardSpec& block) {
  return spec.kind == VarKind::HeadsOut ? block.local[0] : block.local[0] * block.local[1];
}

std::vector<float> block_scales(const float* scales, const VariableSpec& spec, const ShardSpec& s) {
  ShardSpec rows;  // the scales seen as (d0, 1, 1) or (d0, d1, 1)
  const int row_dims = spec.kind == VarKind::HeadsOut ? 1 : 2;
  for (int d = 0; d < row_dims; ++d) {
    rows.full[size_t(d)] = s.full[size_t(d)];
    rows.local[size_t(d)] = s.local[size_t(d)];
    rows.offset[size_t(d)] = s.offset[size_t(d)];
    rows.axis[size_t(d)] = s.axis[size_t(d)];
  }
  return take_block(scales, rows);
}

WeightMatrix matrix_block(const WeightMatrix& w, const VariableSpec& spec, const ShardSpec& s) {
  // The runs of local[2] values, each inside one matrix row, one after another.
  const size_t element = dtype_size(w.dtype), run = size_t(s.local[2]) * element;
  struct Storage {
    std::vector<std::byte> bytes;
    std::vector<float> scales;
  };
  auto storage = std::make_shared<Storage>();
  storage->bytes.resize(size_t(s.local_size()) * element);
  std::byte* out = storage->bytes.data();
  for (int64_t a = 0; a < s.local[0]; ++a)
    for (int64_t b = 0; b < s.local[1]; ++b, out += run) {
      const int64_t flat = ((a + s.offset[0]) * s.full[1] + (b + s.offset[1])) * s.full[2] + s.offset[2];
      std::memcpy(out, static_cast<const std::byte*>(w.data) + size_t(flat) * element, run);
    }
  WeightMatrix block;
  block.rows = block_rows(spec, s);
  block.cols = s.local_size() / block.rows;
  block.dtype = w.dtype;
  block.data = storage->bytes.data();
  if (w.dtype == DType::I8) {
    storage->scales = block_scales(w.scales, spec, s);
    block.scales = storage->scales.data();
  }
  block.owner = storage;
  return block;
}

void combine_row_maxima(const VariableSpec& spec, const ShardSpec& block, DeviceMesh& mesh, float* row_max) {
  const std::vector<int> column_dims = spec.kind == VarKind::HeadsOut ? std::vector<int>{1, 2} : std::vector<int>{2};
  std::vector<int> axes;
  for (int d : column_dims)
    if (const int axis = block.axis[size_t(d)]; axis >= 0 && std::find(axes.begin(), axes.end(), axis) == axes.end())
      axes.push_back(axis);
  for (int axis : axes) mesh.axis_comm(axis).all_reduce_max({row_max, size_t(block_rows(spec, block))});
}

std::vector<float> read_block(const GemmaModel& m, const VariableSpec& spec, const ShardSpec& s) {
  const WeightMatrix* w = m.matrix(spec.slot, spec.layer);
  return w ? matrix_block(*w, spec, s).to_f32() : take_block(m.vector(spec.slot, spec.layer)->data(), s);
}

bool holds_only_block(const GemmaModel& m, const VariableSpec& spec, const ShardSpec& s) {
  const WeightMatrix* w = m.matrix(spec.slot, spec.layer);
  const int64_t stored = w ? w->rows * w->cols : int64_t(m.vector(spec.slot, spec.layer)->size());
  return stored == s.local_size() && stored < s.full_size();
}

// When block `s` of matrix `w` (our 3-D view) is a run of whole rows, `view` becomes those rows of
// `w`, sharing its storage (any dtype); returns false otherwise.
static bool whole_rows(const WeightMatrix& w, const ShardSpec& s, WeightMatrix& view) {
  const bool contiguous = s.local[2] == s.full[2] && (s.local[0] == 1 || s.local[1] == s.full[1]);
  const int64_t first = (s.offset[0] * s.full[1] + s.offset[1]) * s.full[2] + s.offset[2];
  if (!contiguous || first % w.cols != 0 || s.local_size() % w.cols != 0) return false;
  view = w;
  view.rows = s.local_size() / w.cols;
  view.data = static_cast<const std::byte*>(w.data) + size_t(first) * dtype_size(w.dtype);
  if (w.dtype == DType::I8) view.scales = w.scales + first / w.cols;
  return true;
}

// A block's values as fp32 for a collective: its own buffer when it is fp32, else a widened copy.
static const float* f32_values(const WeightMatrix& values, std::vector<float>& widened) {
  if (values.dtype == DType::F32) return values.f32();
  widened = values.to_f32();
  return widened.data();
}

ShardedModel::ShardedModel(GemmaModel model, const LayoutMap& layout, DeviceMesh& mesh, const TensorParallelPlan& plan)
    : model_(std::move(model)), mesh_(&mesh), plan_(plan) {
  for (const VariableSpec& spec : gemma_variables(model_.config)) {
    ShardSpec shard = make_shard_spec(our_dimensions(spec.kind), spec.keras_shape,
                                      layout.resolve(spec.keras_path, spec.keras_shape, mesh), mesh);
    if (!shard.split()) continue;
    // A variable that already holds just this block was loaded that way (sharded loading): keep it
    // as it is (in its dtype: fp32, bf16 or int8). A block of whole rows of a memory-mapped checkpoint is a view of the
    // file; other blocks are copied in the stored dtype (so the whole buffer can be freed).
    const WeightMatrix* w = model_.matrix(spec.slot, spec.layer);
    const bool loaded_as_block = holds_only_block(model_, spec, shard);
    WeightMatrix values;
    if (w && loaded_as_block) values = *w;
    else if (w && w->mapped && whole_rows(*w, shard, values)) {}
    else if (w) values = matrix_block(*w, spec, shard);
    else values = WeightMatrix::from_f32(1, shard.local_size(), take_block(variable_values(model_, spec).data(), shard));
    blocks_.push_back({spec, shard, std::move(values)});
    set_variable(model_, spec, {});  // keep only the block
  }
}

// Int8 weights are used only as each process' own tensor-parallel part (see the header).
static void check_not_int8(const WeightMatrix& w, const VariableSpec& spec) {
  check(w.dtype != DType::I8, spec.keras_path, ": int8 weights split across the mesh can only be used as each process' "
        "tensor-parallel part, not gathered (that would compute with dequantized floats, not int8): split every block's "
        "heads and FFN width over one model axis, as the tutorial's and KerasHub's layout maps do, or use float weights");
}

GemmaModel ShardedModel::materialize() const {
  GemmaModel m = model_;
  for (const Block& b : blocks_) {
    check_not_int8(b.values, b.spec);
    std::vector<float> full(static_cast<size_t>(b.shard.full_size()));
    std::vector<float> widened;
    gather_full(f32_values(b.values, widened), b.shard, *mesh_, full.data());
    set_variable(m, b.spec, std::move(full));
  }
  return m;
}

// Stores `values` (region-sized fp32, or a non-owning view of `shared`) as variable `spec` of w/m.
static void put_region(GemmaModel& m, DecoderLayerWeights* w, const VariableSpec& spec, const ShardSpec& region,
                       std::vector<float> values, const WeightMatrix* shared = nullptr) {
  WeightMatrix* matrix = w ? w->matrix(spec.slot) : m.matrix(spec.slot, spec.layer);
  if (!matrix) {
    WeightVector& vec = w ? *w->vector(spec.slot) : *m.vector(spec.slot, spec.layer);
    vec = shared ? shared->to_f32() : std::move(values);
    return;
  }
  const int64_t rows = block_rows(spec, region), cols = region.local_size() / rows;
  if (!shared) {
    *matrix = WeightMatrix::from_f32(rows, cols, std::move(values));
    return;
  }
  WeightMatrix view = *shared;  // the ShardedModel's block itself, in its dtype: no copy
  view.rows = rows;
  view.cols = cols;
  *matrix = view;
}

void set_variable(GemmaModel& m, const VariableSpec& spec, const ShardSpec& region, std::vector<float> values) {
  put_region(m, nullptr, spec, region, std::move(values));
}

GemmaModel ShardedModel::compute_model(bool by_layer) const {
  GemmaModel m = model_;
  m.config = plan_.local_config(model_.config);
  if (plan_.active()) m.vocab_offset = plan_.vocab_offset(model_.config);
  std::vector<const Block*> deferred;
  for (const VariableSpec& spec : gemma_variables(model_.config)) {
    const ShardSpec region = plan_.compute_region(spec);
    const Block* block = nullptr;
    for (const Block& b : blocks_)
      if (b.spec.slot == spec.slot && b.spec.layer == spec.layer) block = &b;
    if (!block) {  // replicated: tensor parallelism may use a slice of it (K/V heads)
      if (same_region(region, whole_shard_spec(our_dimensions(spec.kind), spec.keras_shape))) continue;
      const WeightMatrix& whole = *model_.matrix(spec.slot, spec.layer);
      WeightMatrix rows;
      if (whole_rows(whole, region, rows)) {
        *m.matrix(spec.slot, spec.layer) = rows;  // shared
      } else {
        check_not_int8(whole, spec);
        put_region(m, nullptr, spec, region, read_block(model_, spec, region));
      }
      continue;
    }
    if (contains(region, block->shard) && !relative(block->shard, region).split()) {
      put_region(m, nullptr, spec, region, {}, &block->values);  // this process' block is its region
      continue;
    }
    check_not_int8(block->values, spec);
    if (by_layer && spec.layer >= 0) {
      deferred.push_back(block);
    } else {
      std::vector<float> widened;
      put_region(m, nullptr, spec, region,
                 gather_region(f32_values(block->values, widened), block->shard, region, *mesh_));
    }
  }
  if (!deferred.empty())
    m.layer_source = [this, layers = m.layers, deferred](int layer) {
      DecoderLayerWeights w = layers[size_t(layer)];
      GemmaModel unused;
      for (const Block* b : deferred) {
        if (b->spec.layer != layer) continue;
        const ShardSpec region = plan_.compute_region(b->spec);
        std::vector<float> widened;
        put_region(unused, &w, b->spec, region, gather_region(f32_values(b->values, widened), b->shard, region, *mesh_));
      }
      return w;
    };
  return m;
}

GemmaModel merge_lora_parts(const GemmaModel& compute, const LoraWeights& lora, const GemmaConfig& whole,
                            const TensorParallelPlan& plan) {
  if (!plan.active()) return merge_lora(compute, lora);
  std::map<std::pair<int, Slot>, ShardSpec> regions;  // of every adaptable variable
  for (const VariableSpec& spec : gemma_variables(whole)) regions[{spec.layer, spec.slot}] = plan.compute_region(spec);
  return merge_lora(compute, lora, whole, [regions](const LoraAdapter& ad, const std::vector<float>& delta) {
    return take_block(delta.data(), regions.at({ad.layer, ad.slot}));
  });
}

size_t ShardedModel::held_bytes() const {
  size_t bytes = model_.weight_bytes();
  for (const Block& b : blocks_) bytes += b.values.nbytes();
  return bytes;
}

}  // namespace meshtune
