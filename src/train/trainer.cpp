// The fit loop (Keras' fit: epochs or steps, gradient accumulation, the learning-rate schedule,
// running metrics), one training step, evaluation, and checkpoints through store/checkpoint.h.
#include "train/trainer.h"

#include <algorithm>
#include <cmath>
#include <chrono>

#include "core/error.h"
#include "store/checkpoint.h"
#include "train/host_staging.h"

namespace meshtune {


bool Trainer::is_main_process() const { return !dist_.mesh || dist_.mesh->comm().rank() == 0; }

long long Trainer::trainable_count() const {
  long long n = 0;
  for (const Trainable& t : trainables_) n += (long long)t.whole_size;  // whole tensors, not blocks
  return n;
}

void Trainer::zero_gradients() {
  std::vector<Floats> grads;
  for (Trainable& t : trainables_) grads.push_back(t.grad.part(0, t.size));
  backend_->zero(grads);
}

void Trainer::accumulate_gradients(const Batch& global_batch, double loss_scale, LossSums& sums) {
  const Batch batch = local_rows(global_batch);
  TokenBatch tb{batch.batch_size, batch.seq_len, batch.token_ids.data(), batch.padding_mask.data(),
                batch.targets.data(), batch.sample_weight.data()};
  // Full fine-tuning: into the weights' gradients; LoRA: into the adapters' grad_a / grad_b.
  const Context ctx = context();
  const LossSums s = lora_ ? forward_backward(ctx, training_model(), tb, loss_scale, &grads_, &workspace_)
                          : forward_backward(ctx, model_, tb, loss_scale, &grads_, &workspace_);
  sums.weighted_ce += s.weighted_ce;
  sums.weighted_correct += s.weighted_correct;
  sums.weight += s.weight;
}

LossSums Trainer::optimizer_step(const std::vector<Batch>& micro_batches, double learning_rate) {
  zero_gradients();
  LossSums sums;
  const int64_t n = int64_t(micro_batches.size());
  for (const Batch& batch : micro_batches)
    accumulate_gradients(batch, 1.0 / double(batch.batch_size * batch.seq_len * n), sums);
  finish_gradients(sums);  // sums now cover the whole (global) batch
  stop_if_not_finite(sums);
  apply_update(learning_rate);
  stop_if_update_not_finite();
  return sums;
}

// Keras' TerminateOnNaN: a loss or gradient that is NaN or infinite stops the run with an Error
// before the update, so the weights, the last checkpoint and the outputs stay the last finite ones;
// an update that itself overflows (an absurd learning rate) stops it before anything is saved.
// Every process decides alike (the loss is the global one; the verdict on the tensors is combined
// over the mesh).
const Parameter* Trainer::first_not_finite(bool values) const {
  std::vector<ConstFloats> arrays;
  for (const Parameter& p : params_) arrays.push_back((values ? p.value : p.grad).part(0, p.size));
  const int64_t first = backend_->first_not_finite(arrays);
  const Parameter* bad = first >= 0 ? &params_[size_t(first)] : nullptr;
  double bad_anywhere = bad ? 1 : 0;
  if (dist_.mesh && dist_.mesh->size() > 1) dist_.mesh->comm().all_reduce_sum({&bad_anywhere, 1});
  static const Parameter elsewhere{"a variable held by another process", "", {}, {}, {}, 0};
  return bad ? bad : bad_anywhere > 0 ? &elsewhere : nullptr;
}

void Trainer::stop_if_not_finite(const LossSums& sums) const {
  const int64_t step = step_ + 1;
  const char* kept = " — training stopped before this step's update (as Keras' TerminateOnNaN); the weights, the "
                     "last checkpoint and the outputs are the last finite ones. Lower --lr or check the data and "
                     "base model";
  check(std::isfinite(sums.weighted_ce), "step ", step, ": the loss is ", sums.weighted_ce, kept);
  if (const Parameter* bad = first_not_finite(/*values=*/false))
    fail("step ", step, ": the gradient of ", bad->path, " is not finite", kept);
}

void Trainer::stop_if_update_not_finite() const {
  if (const Parameter* bad = first_not_finite(/*values=*/true))
    fail("step ", step_, ": the update made ", bad->path, " not finite (the learning rate is too large for it) — "
         "training stopped; the last checkpoint and the outputs are the last finite ones");
}

LossSums Trainer::train_step(const Batch& batch, double learning_rate) { return optimizer_step({batch}, learning_rate); }

void Trainer::set_options(const FitOptions& options) {
  const AdamWOptions adamw = options_.adamw;
  options_ = options;
  options_.adamw = adamw;
}

EpochMetrics Trainer::evaluate(const BatchStream& data) { return evaluate_model(context(), inference_model(), data); }

EpochMetrics evaluate_model(const Context& ctx, const GemmaModel& m, const BatchStream& data) {
  double loss_sum = 0, examples = 0, correct = 0, weight = 0;
  for (size_t s = 0; s < data.steps_per_epoch(); ++s) {
    Batch batch = data.batch(0, s);
    TokenBatch tb{batch.batch_size, batch.seq_len, batch.token_ids.data(), batch.padding_mask.data(),
                  batch.targets.data(), batch.sample_weight.data()};
    LossSums sums = forward_backward(ctx, m, tb, 1.0, nullptr);
    loss_sum += sums.weighted_ce / double(batch.seq_len);  // = batch loss × B
    examples += double(batch.batch_size);
    correct += sums.weighted_correct;
    weight += sums.weight;
  }
  return {examples > 0 ? loss_sum / examples : 0, weight > 0 ? correct / weight : 0};
}

EpochMetrics Trainer::fit(const BatchStream& data, const std::vector<TrainingLog*>& logs,
                          const std::atomic<bool>* stop_requested) {
  const int64_t k = std::max(1, options_.grad_accumulation);
  const int64_t batches = int64_t(data.steps_per_epoch());
  const int64_t steps_per_epoch = (batches + k - 1) / k;
  // By steps (epochs 0): N optimizer steps over as many epochs as that takes.
  const bool by_steps = options_.epochs == 0;
  check(!by_steps || options_.max_steps > 0, "fit: epochs 0 needs max_steps");
  int64_t total_steps = by_steps ? options_.max_steps : steps_per_epoch * options_.epochs;
  if (options_.max_steps > 0) total_steps = std::min(total_steps, options_.max_steps);
  EpochMetrics metrics{epoch_examples_ > 0 ? epoch_loss_sum_ / epoch_examples_ : 0,
                       epoch_weight_ > 0 ? epoch_correct_ / epoch_weight_ : 0};
  interrupted_ = false;
  for (TrainingLog* log : logs) log->run_begin(step_, total_steps, options_.epochs);

  while (step_ < total_steps) {
    const int64_t epoch = step_ / steps_per_epoch, first = step_ % steps_per_epoch;
    if (first == 0) epoch_loss_sum_ = epoch_examples_ = epoch_correct_ = epoch_weight_ = 0;
    const int64_t last = std::min(steps_per_epoch, total_steps - epoch * steps_per_epoch);
    for (TrainingLog* log : logs) log->epoch_begin(epoch + 1, options_.epochs, last);
    for (int64_t s = first; s < last; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<Batch> micro_batches;
      double examples = 0, tokens = 0;
      for (int64_t b = s * k; b < std::min(batches, s * k + k); ++b) {
        micro_batches.push_back(data.batch(size_t(epoch), size_t(b)));
        examples += double(micro_batches.back().batch_size);
        tokens += double(micro_batches.back().batch_size * micro_batches.back().seq_len);
      }
      const double lr = options_.schedule.at(step_);
      const LossSums sums = optimizer_step(micro_batches, lr);
      const double batch_loss_times_b = sums.weighted_ce / double(micro_batches.back().seq_len);  // (Σw·CE/(B·T))·B
      epoch_loss_sum_ += batch_loss_times_b;
      epoch_examples_ += examples;
      epoch_correct_ += sums.weighted_correct;
      epoch_weight_ += sums.weight;
      metrics = {epoch_loss_sum_ / epoch_examples_, epoch_weight_ > 0 ? epoch_correct_ / epoch_weight_ : 0};
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const StepReport report{step_, epoch + 1, s + 1, last, batch_loss_times_b / examples, metrics.loss,
                              metrics.accuracy, lr, tokens / seconds, seconds * 1e3};
      for (TrainingLog* log : logs) log->step_end(report);
      bool stop = stop_requested && stop_requested->load();
      if (dist_.mesh && dist_.mesh->size() > 1) {  // every process stops at the same step
        double any = stop ? 1 : 0;
        dist_.mesh->comm().all_reduce_sum({&any, 1});
        stop = any > 0;
      }
      if (!options_.checkpoint_path.empty() &&
          (stop || (options_.checkpoint_every > 0 && step_ % options_.checkpoint_every == 0))) {
        save_checkpoint(options_.checkpoint_path);
        for (TrainingLog* log : logs) log->checkpoint_saved(step_, options_.checkpoint_path);
      }
      if (stop) {
        interrupted_ = true;
        for (TrainingLog* log : logs) log->run_end(true);
        return metrics;
      }
    }
  }
  for (TrainingLog* log : logs) log->run_end(false);
  if (!options_.checkpoint_path.empty()) save_checkpoint(options_.checkpoint_path);
  return metrics;
}

// ---- checkpoints (the format is store/checkpoint.h's) ------------------------------------------

std::vector<CheckpointTensor> Trainer::checkpoint_tensors(HostStaging& host, bool to_load) const {
  auto view = [&](Floats values) { return to_load ? host.write(values) : host.read(values); };
  std::vector<CheckpointTensor> tensors;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = params_[i];
    tensors.push_back({p.path, view(p.value.part(0, p.size)), view(optimizer_->momentums[i].span().part(0, p.size)),
                       view(optimizer_->velocities[i].span().part(0, p.size)), p.size, trainables_[i].held()});
  }
  return tensors;
}

CheckpointState Trainer::checkpoint_state() const {
  return {lora_ ? "lora" : "full", step_, optimizer_->iterations, epoch_loss_sum_, epoch_examples_, epoch_correct_,
          epoch_weight_, lora_ ? lora_->rank : 0, lora_ ? lora_->alpha : 0};
}

void Trainer::save_checkpoint(const std::string& path) const {
  HostStaging host(*backend_);
  write_checkpoint(path, checkpoint_state(), checkpoint_tensors(host, /*to_load=*/false), dist_.mesh);
}

void Trainer::load_checkpoint(const std::string& path) {
  HostStaging host(*backend_);
  const CheckpointState state =
      read_checkpoint(path, lora_ ? "lora" : "full", checkpoint_tensors(host, /*to_load=*/true), dist_.mesh);
  host.flush();  // on a device: the values read into the staged copies go up
  step_ = state.step;
  optimizer_->iterations = state.iterations;
  epoch_loss_sum_ = state.epoch_loss_sum;
  epoch_examples_ = state.epoch_examples;
  epoch_correct_ = state.epoch_correct;
  epoch_weight_ = state.epoch_weight;
  if (dist_.mesh)  // working copies follow the restored blocks
    for (Trainable& t : trainables_) refresh_working_copy(t);
}

}  // namespace meshtune
