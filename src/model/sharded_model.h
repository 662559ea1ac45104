// A model whose weights are placed on a mesh by a LayoutMap: variables the layout splits are kept
// only as this process' block; replicated ones stay as they were loaded (possibly memory-mapped).
// compute_model() gives what the forward/backward passes use: under a tensor-parallel plan each
// process' share of the heads and FFN width (from its own blocks, no communication), with every
// other split variable all-gathered (FSDP-style: "all-gather before use"); materialize() gives the
// whole model (export). Every process must call them together. Int8 blocks are used only where
// they are the tensor-parallel compute region (an all-gather of int8 weights would compute with
// dequantized floats, not Keras' int8 arithmetic): other int8 splits are an error naming the variable.
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

// Blocks of matrices, in our [out, in] layout: the block's rows are dimension 0 of a (D, N, H) view,
// dimensions 0 and 1 of the others; its columns the rest.
int64_t block_rows(const VariableSpec& spec, const ShardSpec& block);
// Block `s` of matrix `w` copied in w's own dtype, as a matrix of the block's rows. An int8 block
// keeps its rows' scales: they are the whole rows' (a block of columns shares them).
WeightMatrix matrix_block(const WeightMatrix& w, const VariableSpec& spec, const ShardSpec& s);
// The scales of block `s`'s rows, from the whole matrix's (one per row).
std::vector<float> block_scales(const float* scales, const VariableSpec& spec, const ShardSpec& s);
// Int8 quantization of a block (backend/cpu/int8.h) needs each row's max|W| over the whole row: when
// the block holds only some of its rows' columns, `row_max` (block_rows values, the block's own
// maxima) becomes the maximum over the processes holding the other columns (all-reduce-max over
// the mesh axes splitting the columns). Every process holding a block must call it.
void combine_row_maxima(const VariableSpec& spec, const ShardSpec& block, DeviceMesh& mesh, float* row_max);

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
