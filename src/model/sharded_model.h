// A model whose weights are placed on a mesh by a LayoutMap: variables the layout splits are kept
// only as this process' block; replicated ones stay as they were loaded (possibly memory-mapped).
// compute_model() gives what the forward/backward passes use: under a tensor-parallel plan each
// process' share of the heads and FFN width (from its own blocks, no communication), with every
// other split variable all-gathered (FSDP-style: "all-gather before use"); materialize() gives the
// whole model (export). Every process must call them together.
#pragma once
#include <vector>

#include "distribution/sharding.h"
#include "model/tensor_parallel.h"
#include "model/gemma.h"
#include "model/lora.h"

namespace meshtune {

// A variable's values as fp32 in our layout (bf16 widened), and replacing a variable's storage
// (an empty vector releases it).
std::vector<float> variable_values(const GemmaModel& model, const VariableSpec& spec);
void set_variable(GemmaModel& model, const VariableSpec& spec, std::vector<float> values);
// The values of block `s` of a variable (fp32, our layout), reading only the rows the block covers:
// a memory-mapped checkpoint is only touched where the block's bytes are.
std::vector<float> read_block(const GemmaModel& model, const VariableSpec& spec, const ShardSpec& s);
// True when variable `spec` of `model` holds only block `s` (sharded loading left it so), which
// the ShardedModel and the Trainer recognise by its size.
bool holds_only_block(const GemmaModel& model, const VariableSpec& spec, const ShardSpec& s);
// The same for a part of the variable: `region` (in our 3-D view) says which (e.g. a tensor-parallel
// compute region); the matrix gets the region's rows and columns.
void set_variable(GemmaModel& model, const VariableSpec& spec, const ShardSpec& region, std::vector<float> values);

// `compute` (a ShardedModel's compute model, or any model computed as `plan` says) with LoRA merged
// in: under tensor parallelism each process adds only its part of every ΔW. `whole` is the whole
// model's config.
GemmaModel merge_lora_parts(const GemmaModel& compute, const LoraWeights& lora, const GemmaConfig& whole,
                            const TensorParallelPlan& plan);

class ShardedModel {
 public:
  ShardedModel() = default;
  // Resolves every variable's spec (errors name the variable, dimension and axis) and keeps only
  // this process' blocks of the split ones.
  ShardedModel(GemmaModel model, const LayoutMap& layout, DeviceMesh& mesh, const TensorParallelPlan& plan = {});

  GemmaModel materialize() const;
  // The model the passes compute with (see above). `by_layer`: decoder-block variables that need
  // an all-gather are gathered only when a pass reaches their block (GemmaModel::layer_source), so
  // one block is whole at a time. The ShardedModel must outlive the result (blocks are shared, not
  // copied); every process must run the same passes.
  GemmaModel compute_model(bool by_layer) const;
  const TensorParallelPlan& plan() const { return plan_; }
  const GemmaModel& replicated_part() const { return model_; }
  size_t held_bytes() const;  // weights held persistently by this process
  bool has_split() const { return !blocks_.empty(); }

 private:
  struct Block {
    VariableSpec spec;
    ShardSpec shard;
    WeightMatrix values;  // shard.local_size() values, fp32 or bf16 (may share the loader's storage)
  };
  GemmaModel model_;
  std::vector<Block> blocks_;
  DeviceMesh* mesh_ = nullptr;
  TensorParallelPlan plan_;
};

}  // namespace meshtune
