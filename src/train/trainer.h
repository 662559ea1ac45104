// fit(): LoRA or full-parameter fine-tuning of a Gemma model on batches from a BatchStream, with
// Keras' AdamW, loss and metrics, a Keras progress bar, JSONL logs, and checkpoints that resume
// bit-identically (trainable weights, optimizer slots, step, data position and metric sums in one
// atomically written file).
#pragma once
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/batches.h"
#include "model/backward.h"
#include "model/lora.h"
#include "train/optimizer.h"
#include "train/parameter.h"

namespace meshtune {

struct FitOptions {
  int epochs = 1;
  int64_t max_steps = 0;         // stop after this many optimizer steps in total (0 = epochs)
  int grad_accumulation = 1;     // micro-batches per optimizer step
  AdamWOptions adamw;
  LearningRateSchedule schedule;
  std::string checkpoint_path;   // "" = no checkpoints
  int64_t checkpoint_every = 0;  // steps; 0 = only at the end (and on SIGINT/SIGTERM)
  bool resume = false;
  std::string log_jsonl;         // "" = none
  bool progress = true;          // the Keras progress bar on stderr
  int64_t kill_after_step = 0;   // tests only: SIGKILL this process after step N's checkpoint
};

struct EpochMetrics {
  double loss = 0, accuracy = 0;  // running epoch means, as Keras displays them
};

class Trainer {
 public:
  // LoRA when `lora` has adapters (base weights frozen), else full-parameter training (every
  // weight becomes a trainable fp32 copy).
  Trainer(GemmaModel base, std::optional<LoraWeights> lora, const FitOptions& options);

  // Runs the epochs; returns the last epoch's metrics. Stops early (after saving a checkpoint) if
  // `stop_requested` becomes true; then `interrupted()` is true.
  EpochMetrics fit(const BatchStream& data, const std::atomic<bool>* stop_requested = nullptr);
  // Mean loss/accuracy over a data set without updating anything.
  EpochMetrics evaluate(const BatchStream& data);

  // One optimizer step on one batch (no accumulation); returns the batch's loss sums.
  LossSums train_step(const Batch& batch, double learning_rate);

  // The model with the current weights (LoRA merged in), for generation and export.
  GemmaModel current_model() const;
  const std::optional<LoraWeights>& lora() const { return lora_; }
  const GemmaModel& trainable_model() const { return model_; }
  std::vector<Parameter>& parameters() { return params_; }
  int64_t step() const { return step_; }
  bool interrupted() const { return interrupted_; }
  long long trainable_count() const;

  void save_checkpoint(const std::string& path) const;
  void load_checkpoint(const std::string& path);

 private:
  void accumulate_gradients(const Batch& batch, double loss_scale, LossSums& sums);
  void zero_gradients();

  GemmaModel model_;                  // LoRA: the frozen base; full: writable fp32 weights
  std::optional<LoraWeights> lora_;
  FitOptions options_;
  std::vector<Parameter> params_;
  std::vector<std::vector<float>> grad_storage_;  // full fine-tuning gradients, per parameter
  std::vector<std::vector<float>> lora_weight_grads_;  // LoRA: ∂L/∂W_eff per adapter
  ModelGradients grads_;
  std::unique_ptr<AdamW> optimizer_;
  int64_t step_ = 0;                  // optimizer steps done
  double epoch_loss_sum_ = 0, epoch_examples_ = 0, epoch_correct_ = 0, epoch_weight_ = 0;
  bool interrupted_ = false;
};

}  // namespace meshtune
