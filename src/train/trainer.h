// fit(): LoRA or full-parameter fine-tuning of a Gemma model on batches from a BatchStream, with
// Keras' AdamW, loss and metrics, progress through logging sinks (train/training_log.h), and
// checkpoints that resume bit-identically (trainable weights, optimizer slots, step, data position
// and metric sums; store/checkpoint.h). The jobs live in their own files: trainer.cpp the fit
// loop, placement.cpp the trainable tensors' placement on the mesh and their gradients' collectives.
#pragma once
#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/batches.h"
#include "model/sharded_model.h"
#include "model/backward.h"
#include "model/lora.h"
#include "train/optimizer.h"
#include "train/parameter.h"
#include "train/training_log.h"
#include "store/checkpoint.h"

namespace meshtune {

class HostStaging;

struct FitOptions {
  int epochs = 1;                // 0: as many epochs as max_steps needs (the data is cycled)
  int64_t max_steps = 0;         // stop after this many optimizer steps in total (0 = epochs)
  int grad_accumulation = 1;     // micro-batches per optimizer step
  AdamWOptions adamw;
  LearningRateSchedule schedule;
  std::string checkpoint_path;   // "" = no checkpoints
  int64_t checkpoint_every = 0;  // steps; 0 = only at the end (and on SIGINT/SIGTERM)
  bool resume = false;
};

// How training is spread over processes (keras.distribution.ModelParallel / DataParallel): the
// batch is split over `batch_axis`, and each variable is held as the block its LayoutMap spec gives
// (replicated when no rule matches). No mesh = one device.
struct Distribution {
  DeviceMesh* mesh = nullptr;
  LayoutMap layout;
  std::string batch_axis = "batch";
  bool tensor_parallel = true;  // compute heads/FFN width split when the layout allows (model/tensor_parallel.h)
};

struct EpochMetrics {
  double loss = 0, accuracy = 0;  // running epoch means, as Keras displays them
};

// Mean loss/accuracy of `model` over a data set (Keras' evaluate): nothing is updated.
EpochMetrics evaluate_model(const Context& ctx, const GemmaModel& model, const BatchStream& data);

class Trainer {
 public:
  // LoRA when `lora` has adapters (base weights frozen), else full-parameter training (every
  // weight becomes a trainable fp32 copy). The passes run on `backend` with the dtype policy's
  // matmul `precision`.
  Trainer(Backend& backend, MatmulPrecision precision, GemmaModel base, std::optional<LoraWeights> lora,
          const FitOptions& options, const Distribution& distribution = {});

  // Runs the epochs (or steps), reporting to `logs`; returns the last epoch's metrics. Stops early
  // (after saving a checkpoint) if `stop_requested` becomes true; then `interrupted()` is true.
  EpochMetrics fit(const BatchStream& data, const std::vector<TrainingLog*>& logs = {},
                   const std::atomic<bool>* stop_requested = nullptr);
  // Mean loss/accuracy over a data set without updating anything.
  EpochMetrics evaluate(const BatchStream& data);

  // The run's options; set_options changes how long the next fit() runs, its schedule and its
  // checkpoints (the optimizer's settings are fixed when the Trainer is made).
  const FitOptions& options() const { return options_; }
  void set_options(const FitOptions& options);

  // One optimizer step on one batch (no accumulation); returns the batch's loss sums.
  LossSums train_step(const Batch& batch, double learning_rate);

  // The model with the current weights (LoRA merged in), for generation and export. Under a mesh
  // every process takes part (split variables are all-gathered).
  GemmaModel current_model();
  // The current weights as this process computes with them (its tensor-parallel part, LoRA merged
  // once), for generation and evaluation during a run: nothing is gathered whole. Every process
  // must run the same passes on it.
  GemmaModel inference_model();
  // How the models above are computed with: the backend, the precision, and under a
  // tensor-parallel plan this process' group.
  Context context() const;
  // The adapters with their current values (brought back from the backend's memory first).
  const std::optional<LoraWeights>& lora() const;
  const GemmaModel& trainable_model() const { return model_; }
  std::vector<Parameter>& parameters() { return params_; }
  int64_t step() const { return step_; }
  bool interrupted() const { return interrupted_; }
  long long trainable_count() const;

  // Under a mesh of n > 1 processes each writes `path.rank<k>` (its blocks) and rank 0 writes
  // `path` as a manifest naming the mesh and files.
  void save_checkpoint(const std::string& path) const;
  void load_checkpoint(const std::string& path);
  bool is_main_process() const;
  const std::string& plan_summary() const { return plan_.summary; }  // the tensor-parallel plan (mesh runs)  // rank 0 (or no mesh): the one that prints and writes shared files
  // Bytes of model weights this process holds persistently (blocks of split variables, whole
  // replicated ones) — what sharding saves.
  size_t held_weight_bytes() const;

 private:
  // A trainable tensor: the working copy that forward/backward use (`region` of the variable: the
  // whole, or this process' tensor-parallel part) and, when its layout stores another part here
  // (`shard`), that block, which the optimizer updates and the working copy is refreshed from.
  struct Trainable {
    Floats value, grad;     // the working copy and its gradient (backend memory)
    size_t size = 0;        // of the working copy
    size_t whole_size = 0;  // of the whole variable
    ShardSpec region, shard;
    bool partial = false;   // the gradient is this process' share: sum it over the tensor-parallel axis
    FloatBuffer block, block_grad;  // backend memory
    bool separate() const { return !same_region(region, shard); }
    const ShardSpec& held() const { return separate() ? shard : region; }  // what the optimizer updates
  };

  void place_variables();
  // Parameter i's gradient (`size` zeros on the backend); `*backward_hook` is where backward adds.
  Floats gradient_storage(size_t i, size_t size, float** backward_hook);
  void refresh_working_copy(Trainable& t);  // from the block the optimizer updated
  // LoRA: what forward/backward run on (the frozen base with the adapters as low-rank terms over their
  // storage), made by the first step and kept: the adapters are updated in place.
  const GemmaModel& training_model();
  Batch local_rows(const Batch& batch) const;  // this process' slice of the batch axis
  void accumulate_gradients(const Batch& batch, double loss_scale, LossSums& sums);
  void finish_gradients(LossSums& sums);  // sum over the batch axis, cut blocks
  void apply_update(double lr);           // AdamW on blocks, then refresh whole copies
  void zero_gradients();
  // Keras' TerminateOnNaN, before and after the update: Errors naming the step and the variable.
  const Parameter* first_not_finite(bool values) const;  // in the gradients, or the values
  void stop_if_not_finite(const LossSums& sums) const;
  void stop_if_update_not_finite() const;
  // One optimizer step over the micro-batches of a (global) batch: their gradients accumulated,
  // summed over the mesh, AdamW applied. fit() and train_step() both take their steps here.
  LossSums optimizer_step(const std::vector<Batch>& micro_batches, double learning_rate);
  // The parameters and AdamW slots as the checkpoint files take them: host memory. A device
  // backend's are staged in `host`: downloaded to save, or (`to_load`) written by the reader and
  // uploaded by host.flush().
  std::vector<CheckpointTensor> checkpoint_tensors(HostStaging& host, bool to_load) const;
  CheckpointState checkpoint_state() const;

  Backend* backend_;
  MatmulPrecision precision_;
  Distribution dist_;
  GemmaConfig config_;        // the whole model's (model_.config is this process' part under TP)
  TensorParallelPlan plan_;
  std::vector<Trainable> trainables_;
  ShardedModel frozen_;  // LoRA under a mesh: the frozen base, split variables as blocks
  GemmaModel model_;                  // LoRA: the frozen base; full: writable fp32 weights
  bool int8_base_ = false;            // the frozen base has int8 matrices
  mutable std::optional<LoraWeights> lora_;  // host copies (files, merging): current after lora()
  LoraTensors lora_tensors_;                 // the adapters and their gradients on the backend
  std::optional<GemmaModel> training_model_;  // training_model(), once made
  FitOptions options_;
  std::vector<Parameter> params_;
  std::vector<FloatBuffer> grad_storage_;  // full fine-tuning gradients, per parameter, on the backend
  ModelGradients grads_;
  TrainingWorkspace workspace_;  // activations and temporaries, reused from step to step
  std::unique_ptr<AdamW> optimizer_;
  int64_t step_ = 0;                  // optimizer steps done
  double epoch_loss_sum_ = 0, epoch_examples_ = 0, epoch_correct_ = 0, epoch_weight_ = 0;
  bool interrupted_ = false;
};

}  // namespace meshtune
