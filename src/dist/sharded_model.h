// A model whose weights are placed on a mesh by a LayoutMap: variables the layout splits are kept
// only as this process' block; replicated ones stay as they were loaded (possibly memory-mapped).
// materialize() all-gathers the split variables into a whole model for the next forward pass
// (FSDP-style: "all-gather before use"), which every process must call together.
#pragma once
#include <vector>

#include "dist/sharding.h"
#include "model/gemma.h"

namespace meshtune {

// A variable's values as fp32 in our layout (bf16 widened), and replacing a variable's storage
// (an empty vector releases it).
std::vector<float> variable_values(const GemmaModel& model, const VariableSpec& spec);
void set_variable(GemmaModel& model, const VariableSpec& spec, std::vector<float> values);

class ShardedModel {
 public:
  ShardedModel() = default;
  // Resolves every variable's spec (errors name the variable, dimension and axis) and keeps only
  // this process' blocks of the split ones.
  ShardedModel(GemmaModel model, const LayoutMap& layout, DeviceMesh& mesh);

  GemmaModel materialize() const;
  // The same model, but decoder blocks are all-gathered only when the forward or backward pass
  // reaches them (GemmaModel::layer_source), so one block is whole at a time. The ShardedModel must
  // outlive the result; every process must run the same passes.
  GemmaModel materialize_by_layer() const;
  const GemmaModel& replicated_part() const { return model_; }
  size_t held_bytes() const;  // weights held persistently by this process
  bool has_split() const { return !blocks_.empty(); }

 private:
  struct Block {
    VariableSpec spec;
    ShardSpec shard;
    std::vector<float> values;
  };
  GemmaModel model_;
  std::vector<Block> blocks_;
  DeviceMesh* mesh_ = nullptr;
};

}  // namespace meshtune
