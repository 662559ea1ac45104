// Training checkpoints (format "meshtune-checkpoint-1"): one safetensors file holding every
// trainable tensor with its AdamW slots (param/…, momentum/…, velocity/…) and the run's state as
// metadata strings (step, optimizer iterations, the epoch's metric sums, LoRA rank/alpha). Under a
// mesh of n > 1 processes each rank writes `path.step<S>.rank<k>` (its blocks, each with its
// placement in the whole variable) and rank 0 then switches `path`, a JSON manifest naming the
// mesh and the files, to the new step; a rank's older files are removed after that. Every file
// written atomically, so a crash leaves the previous checkpoint whole.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/tensor.h"
#include "distribution/mesh.h"
#include "distribution/sharding.h"

namespace meshtune {

// The run's state besides the tensors.
struct CheckpointState {
  std::string mode;  // "lora" or "full"
  int64_t step = 0, iterations = 0;
  double epoch_loss_sum = 0, epoch_examples = 0, epoch_correct = 0, epoch_weight = 0;
  int lora_rank = 0;
  double lora_alpha = 0;
};

// One trainable tensor as this process holds it (`size` values each), and — under a mesh — where
// its block lies in the whole variable.
struct CheckpointTensor {
  std::string path;  // Keras path, e.g. ".../attention/query/lora_kernel_a"
  Span<float> value, momentum, velocity;  // host memory (a device's tensors are staged by the caller)
  size_t size = 0;
  ShardSpec placement;
};

// Writes this process' checkpoint (every process of `mesh` calls it together; null = one process).
void write_checkpoint(const std::string& path, const CheckpointState& state, const std::vector<CheckpointTensor>& tensors,
                      DeviceMesh* mesh);

// Restores what write_checkpoint wrote for this process into `tensors` (values and AdamW slots,
// sizes checked) and returns the state; the checkpoint must be of `mode` ("lora" or "full"). A
// manifest must be resumed on the mesh it names; errors name the file and the tensor.
CheckpointState read_checkpoint(const std::string& path, const std::string& mode,
                                const std::vector<CheckpointTensor>& tensors, DeviceMesh* mesh);

// The trainable weights of a checkpoint — one file, or a sharded run's manifest (every rank's
// blocks reassembled from the placement each file records): whole variables by Keras path (LoRA
// matrices in Keras layout, model weights in our layout). For `export --checkpoint`.
struct TrainedParameters {
  std::string mode;  // "lora" or "full"
  int64_t step = 0;
  int lora_rank = 0;
  double lora_alpha = 0;
  std::map<std::string, std::vector<float>> values;
};
TrainedParameters read_trained_parameters(const std::string& manifest_or_file);

}  // namespace meshtune
