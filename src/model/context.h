// What model and train code are handed beside the weights: the backend that holds the memory and
// runs the ops, the dtype policy's matmul precision, and the tensor-parallel group with its
// collectives named by what they do in the math. Weights (GemmaModel) never carry how they are run.
#pragma once
#include <cstdint>

#include "backend/backend.h"
#include "distribution/communicator.h"

namespace meshtune {

// The collectives of tensor parallelism (Megatron's): each process computes a part of the heads,
// of the FFN width and of the vocabulary, and these put the parts back together. Without a group
// (one process, or no tensor-parallel plan) each is nothing or a copy. Operands are device-tagged
// spans, checked by the communicator: MPI's works on host memory, so a device operand is an Error
// until a device communicator (NCCL) is handed in here.
class TensorParallelGroup {
 public:
  TensorParallelGroup() = default;
  explicit TensorParallelGroup(Communicator* comm) : comm_(comm) {}
  bool active() const { return comm_ != nullptr; }
  int size() const { return comm_ ? comm_->size() : 1; }

  // The row-parallel sum: each process holds a partial product (attention_output over its heads,
  // ffw_linear over its FFN columns; in backward the input gradients of q/k/v and gate/up, and of
  // the split vocabulary's lookups); afterwards every process holds their sum.
  void sum_partials(Floats x) const;
  // Each token's largest |x| over the whole input of which each process holds a slice (int8
  // quantizes the whole token, as Keras does on a sharded array).
  void max_over_slices(Floats row_max) const;
  // The vocabulary-parallel loss statistics of n rows: the row maxima and their indices combined
  // (the first process holding the overall maximum wins), then Σexp and the target logits summed.
  void combine_row_max(Backend& backend, SoftmaxRows& stats, int64_t n) const;
  void sum_row_sums(SoftmaxRows& stats, int64_t n) const;
  // The vocabulary-parallel logits: each process' [M, part] columns, gathered (process order =
  // vocabulary order) into `gathered` and laid out as rows of [M, size·part] in `out`.
  void gather_columns(Backend& backend, ConstFloats mine, int64_t M, int64_t part, Floats gathered,
                      Floats out) const;

 private:
  Communicator* comm_ = nullptr;
};

struct Context {
  Backend& backend;
  // The dtype policy's matmul inputs: F32 for float32; BF16 for mixed_bfloat16 and bfloat16 — the
  // projections, the tied head and their input gradients take bf16 inputs with fp32 sums; norms,
  // RoPE, attention and the loss stay fp32.
  MatmulPrecision precision = MatmulPrecision::F32;
  // Set when the weights are this process' share of the heads, FFN width and vocabulary.
  TensorParallelGroup tensor_parallel = {};
};

}  // namespace meshtune
