#include "model/tensor_parallel.h"

#include <algorithm>

#include "core/error.h"

namespace meshtune {

GemmaConfig TensorParallelPlan::local_config(const GemmaConfig& whole) const {
  GemmaConfig c = whole;
  if (!active()) return c;
  c.num_query_heads = whole.num_query_heads / parts;
  c.num_key_value_heads = kv_heads;
  c.ffw_dim = whole.ffw_dim / parts;
  return c;  // query_scale_dim is stored, so the local head count does not change the scaling
}

ShardSpec TensorParallelPlan::compute_region(const VariableSpec& spec) const {
  ShardSpec s = whole_shard_spec(our_dimensions(spec.kind), spec.keras_shape);
  if (!active()) return s;
  // Our 3-D views: q/k/v (heads, H, D), attention_output (D, N, H), gating (1, F, D), linear (1, D, F).
  auto part_of = [&](int64_t n) { return n / parts; };
  switch (spec.slot) {
    case Slot::Query: narrow(s, 0, axis, part_of(s.full[0]) * index, part_of(s.full[0])); break;
    case Slot::Key:
    case Slot::Value: narrow(s, 0, axis, kv_offset, kv_heads); break;
    case Slot::AttentionOutput: narrow(s, 1, axis, part_of(s.full[1]) * index, part_of(s.full[1])); break;
    case Slot::FfwGating:
    case Slot::FfwGating2: narrow(s, 1, axis, part_of(s.full[1]) * index, part_of(s.full[1])); break;
    case Slot::FfwLinear: narrow(s, 2, axis, part_of(s.full[2]) * index, part_of(s.full[2])); break;
    case Slot::Embeddings:  // (1, V, D)
      if (vocab) narrow(s, 1, axis, part_of(s.full[1]) * index, part_of(s.full[1]));
      break;
    default: break;
  }
  return s;
}

bool TensorParallelPlan::gradient_is_partial(const VariableSpec& spec) const {
  if (!active()) return false;
  if (spec.slot == Slot::QueryNorm || spec.slot == Slot::KeyNorm) return true;
  return kv_shared && (spec.slot == Slot::Key || spec.slot == Slot::Value);
}

// The mesh axis a rule puts on Keras dimension `dim` of a variable ("" = none).
static std::string axis_of(const PartitionSpec& spec, size_t dim) {
  return dim < spec.size() && spec[dim] ? *spec[dim] : std::string();
}

TensorParallelPlan plan_tensor_parallel(const GemmaConfig& c, const LayoutMap& layout,
                                        const std::vector<int>& mesh_shape, const std::vector<std::string>& axis_names,
                                        const std::string& batch_axis, const std::vector<int>& coordinates,
                                        bool enabled) {
  TensorParallelPlan plan;
  const std::string fallback = "; split variables are all-gathered before use (FSDP-style)";
  if (!enabled) {
    plan.summary = "tensor parallelism off (--no-tensor-parallel)" + fallback;
    return plan;
  }
  // The axis is the one splitting the first block's query heads; every block must agree.
  const std::vector<VariableSpec> variables = gemma_variables(c);
  auto spec_of = [&](const VariableSpec& v) { return layout.resolve(v.keras_path, v.keras_shape, mesh_shape, axis_names); };
  std::string axis, why_not;
  for (const VariableSpec& v : variables)
    if (v.layer == 0 && v.slot == Slot::Query) {
      axis = axis_of(spec_of(v), 0);
      if (axis.empty()) why_not = "no layout rule splits " + v.keras_path + " over its heads";
    }
  for (const VariableSpec& v : variables) {
    if (v.layer < 0 || !why_not.empty()) continue;
    const PartitionSpec spec = spec_of(v);
    std::string want;  // the dimension that must be split by `axis` (Keras layout)
    switch (v.slot) {
      case Slot::Query:
      case Slot::AttentionOutput: want = axis_of(spec, 0); break;  // (N, D, H) / (N, H, D)
      case Slot::Key:
      case Slot::Value: want = axis_of(spec, 0).empty() ? axis : axis_of(spec, 0); break;  // heads, or whole
      case Slot::FfwGating:
      case Slot::FfwGating2: want = axis_of(spec, 1); break;  // (D, F)
      case Slot::FfwLinear: want = axis_of(spec, 0); break;   // (F, D)
      default: want = axis; break;  // norm scales: any layout (gathered)
    }
    if (want != axis) why_not = v.keras_path + " is not split over its " +
                                std::string(v.slot >= Slot::FfwGating ? "width" : "heads") + " by '" + axis + "'";
  }
  if (axis == batch_axis && why_not.empty()) why_not = "the heads are split over the batch axis '" + axis + "'";
  const auto at = std::find(axis_names.begin(), axis_names.end(), axis);
  if (why_not.empty() && at == axis_names.end()) why_not = "no mesh axis '" + axis + "'";
  if (why_not.empty()) {
    const size_t a = size_t(at - axis_names.begin());
    const int p = mesh_shape[a], N = c.num_query_heads, K = c.num_key_value_heads;
    if (p == 1) {
      why_not = "the '" + axis + "' axis has size 1";
    } else if (K % p != 0 && p % K != 0) {
      why_not = std::to_string(K) + " KV heads cannot follow " + std::to_string(N) + " query heads split " +
                std::to_string(p) + " ways";
    } else {
      plan.axis = int(a);
      plan.axis_name = axis;
      plan.parts = p;
      plan.index = coordinates.empty() ? 0 : coordinates[a];
      const int q0 = plan.index * (N / p), group = N / K;
      plan.kv_shared = K % p != 0;
      plan.kv_heads = K % p == 0 ? K / p : 1;
      plan.kv_offset = K % p == 0 ? plan.index * (K / p) : q0 / group;
      for (const VariableSpec& v : variables)
        if (v.slot == Slot::Embeddings) plan.vocab = axis_of(spec_of(v), 0) == axis;
      plan.summary = "tensor parallel over '" + axis + "' (" + std::to_string(p) + " ways): " + std::to_string(N / p) +
                     " of " + std::to_string(N) + " query heads, " + std::to_string(plan.kv_heads) + " of " +
                     std::to_string(K) + " KV heads" + (K % p == 0 ? "" : " (shared)") + ", " +
                     std::to_string(c.ffw_dim / p) + " of " + std::to_string(c.ffw_dim) + " FFN columns" +
                     (plan.vocab ? ", " + std::to_string(c.vocab_size / p) + " of " + std::to_string(c.vocab_size) +
                                       " vocabulary rows (embedding and logits)"
                                 : "") +
                     " per device; other split variables are all-gathered before use";
      return plan;
    }
  }
  plan.summary = "no tensor parallelism (" + why_not + ")" + fallback;
  return plan;
}

TensorParallelPlan plan_tensor_parallel(const GemmaConfig& config, const LayoutMap& layout, const DeviceMesh& mesh,
                                        const std::string& batch_axis, bool enabled) {
  std::vector<int> coordinates;
  for (size_t a = 0; a < mesh.shape().size(); ++a) coordinates.push_back(mesh.coordinate(int(a)));
  return plan_tensor_parallel(config, layout, mesh.shape(), mesh.axis_names(), batch_axis, coordinates, enabled);
}

}  // namespace meshtune
