// Tensor parallelism (Megatron-style), planned from the LayoutMap: when every decoder block's
// query and attention_output kernels are split over their heads, and its three FFN kernels over
// their width, by one mesh axis (the "model" axis of KerasHub's and the tutorial's maps), each
// process computes attention for its heads and the FFN for its slice of the width, and the two
// partial block outputs are summed over that axis (one all-reduce each, forward and backward).
// Keys/values follow the query heads: a process uses the KV heads its query heads read (a slice
// of a replicated kernel when the layout leaves K/V whole, e.g. 1 KV head on a 2-wide axis).
//
// When the embedding is split over its vocabulary rows by the same axis, the lookup, the logits
// and the cross-entropy are split too (vocabulary-parallel: each process computes its columns of
// the logits; the softmax's max, sum and target logit are combined across processes).
//
// Everything else a layout splits (dimensions split over other axes such as
// KerasHub's hidden dimension over "batch") is all-gathered before use (FSDP-style). Layouts that
// do not have this shape run with every split variable all-gathered; `summary` says which plan
// was chosen and why.
#pragma once
#include <string>
#include <vector>

#include "distribution/layout.h"
#include "distribution/sharding.h"
#include "model/config.h"
#include "model/variables.h"

namespace meshtune {

struct TensorParallelPlan {
  int axis = -1;                    // mesh axis splitting heads and FFN width in compute; -1 = none
  std::string axis_name;
  int parts = 1, index = 0;         // that axis' size, and this process' coordinate on it
  int kv_heads = 0, kv_offset = 0;  // the key/value heads this process computes with
  bool kv_shared = false;           // fewer KV heads than parts: several processes read each
  bool vocab = false;               // the embedding is split by vocabulary rows over the axis too
  std::string summary;              // one line for logs and `info`: the plan, or why there is none

  bool active() const { return axis >= 0; }
  // The config of the part of the model this process computes: N/p query heads, its KV heads, F/p.
  GemmaConfig local_config(const GemmaConfig& whole) const;
  // The region of variable `spec` (whole, in our 3-D layout) that this process computes with.
  ShardSpec compute_region(const VariableSpec& spec) const;
  int64_t vocab_offset(const GemmaConfig& whole) const { return vocab ? int64_t(whole.vocab_size / parts) * index : 0; }
  // True when this process' gradient of the variable is only its share, to be summed over the
  // axis: the Gemma 3 query/key norm scales (shared by all heads) and key/value kernels when KV
  // heads are shared.
  bool gradient_is_partial(const VariableSpec& spec) const;
};

// The plan for `config` under `layout` on a mesh of `mesh_shape` / `axis_names` (the batch is split
// over `batch_axis`), for the process at `coordinates` (all zero for a dry run). `enabled` = false
// (--no-tensor-parallel) gives the all-gather plan.
TensorParallelPlan plan_tensor_parallel(const GemmaConfig& config, const LayoutMap& layout,
                                        const std::vector<int>& mesh_shape, const std::vector<std::string>& axis_names,
                                        const std::string& batch_axis, const std::vector<int>& coordinates,
                                        bool enabled = true);
TensorParallelPlan plan_tensor_parallel(const GemmaConfig& config, const LayoutMap& layout, const DeviceMesh& mesh,
                                        const std::string& batch_axis, bool enabled = true);

}  // namespace meshtune
