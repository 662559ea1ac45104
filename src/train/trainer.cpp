#include "train/trainer.h"

#include <unistd.h>

#include <csignal>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <map>

#include "core/error.h"
#include "core/file_util.h"
#include "core/json.h"
#include "model/sharded_model.h"
#include "io/safetensors.h"
#include "model/variables.h"
#include "train/progress.h"

namespace meshtune {

namespace fs = std::filesystem;

// A variable's value storage (fp32 and writable for trainable variables) and the gradient pointer
// that backward fills for it.
struct SlotRef {
  float* value = nullptr;
  size_t size = 0;
  float** grad = nullptr;
};

static SlotRef slot_ref(GemmaModel& m, ModelGradients& g, const VariableSpec& spec) {
  float*& grad = g.of(spec.slot, spec.layer);
  if (WeightMatrix* w = m.matrix(spec.slot, spec.layer))
    return {const_cast<float*>(w->f32()), size_t(w->rows * w->cols), &grad};
  std::vector<float>* v = m.vector(spec.slot, spec.layer);
  return {v->data(), v->size(), &grad};
}

static std::string short_name(const std::string& path) { return path.substr(path.rfind('/') + 1); }

Trainer::Trainer(GemmaModel base, std::optional<LoraWeights> lora, const FitOptions& options,
                 const Distribution& distribution)
    : dist_(distribution), model_(std::move(base)), lora_(std::move(lora)), options_(options) {
  config_ = model_.config;
  const GemmaConfig& c = config_;
  grads_.layers.assign(size_t(c.num_layers), LayerGradients{});
  if (lora_ && lora_->adapters.empty()) lora_.reset();
  if (lora_) {
    validate_lora(c, *lora_, "LoRA adapter");
    for (LoraAdapter& ad : lora_->adapters) {
      ad.grad_a.assign(ad.a.size(), 0.f);
      ad.grad_b.assign(ad.b.size(), 0.f);
      const std::string path = ad.keras_path(c);
      params_.push_back({path + "/lora_kernel_a", "lora_kernel_a", ad.a_shape, ad.a.data(), ad.grad_a.data(), ad.a.size()});
      params_.push_back({path + "/lora_kernel_b", "lora_kernel_b", ad.b_shape, ad.b.data(), ad.grad_b.data(), ad.b.size()});
    }
  } else {
    // Writable fp32 working copies (full fine-tuning updates in place). Under a mesh
    // place_variables() makes them: only this process' part, read from the stored weights.
    const auto specs = gemma_variables(c);
    grad_storage_.resize(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      if (!dist_.mesh) set_variable(model_, specs[i], variable_values(model_, specs[i]));
      params_.push_back({specs[i].keras_path, short_name(specs[i].keras_path), specs[i].hf_shape, nullptr, nullptr,
                         size_t(num_elements(specs[i].hf_shape))});
      if (dist_.mesh) continue;
      SlotRef ref = slot_ref(model_, grads_, specs[i]);
      grad_storage_[i].assign(ref.size, 0.f);
      *ref.grad = grad_storage_[i].data();
      params_.back().value = ref.value;
      params_.back().grad = grad_storage_[i].data();
    }
  }
  place_variables();
  optimizer_ = std::make_unique<AdamW>(options_.adamw, params_);
  if (dist_.mesh && dist_.mesh->size() > 1)
    optimizer_->sum_squared_norms = [this](std::vector<double>& squared_norms) {
      // Every process holds a block of each variable, and each block is held by mesh size ÷
      // (number of blocks) processes: sum the blocks' squares over all, counting each block once.
      DeviceMesh& mesh = *dist_.mesh;
      for (size_t i = 0; i < squared_norms.size(); ++i) {
        const Trainable& t = trainables_[i];
        const double holders = double(mesh.size()) * double(t.held().local_size()) / double(t.held().full_size());
        squared_norms[i] /= holders;
      }
      mesh.comm().all_reduce_sum(squared_norms.data(), squared_norms.size());
    };
}

// ---- placement on the mesh --------------------------------------------------------------------

void Trainer::place_variables() {
  for (const Parameter& p : params_) {
    Trainable t;
    t.value = p.value;
    t.grad = p.grad;
    t.size = t.whole_size = p.size;
    trainables_.push_back(std::move(t));
  }
  if (!dist_.mesh) return;
  DeviceMesh& mesh = *dist_.mesh;
  plan_ = plan_tensor_parallel(config_, dist_.layout, mesh, dist_.batch_axis, dist_.tensor_parallel);
  if (is_main_process() && options_.progress) std::fprintf(stderr, "meshtune: %s\n", plan_.summary.c_str());
  if (lora_) {
    // The frozen base: blocks of the split variables only. LoRA matrices are used whole (in their
    // own, Keras, layout); under tensor parallelism each process' gradient is its heads' share.
    frozen_ = ShardedModel(std::move(model_), dist_.layout, mesh, plan_);
    model_ = frozen_.replicated_part();
    for (size_t i = 0; i < lora_->adapters.size(); ++i) {
      const LoraAdapter& ad = lora_->adapters[i];
      for (int which = 0; which < 2; ++which) {
        Trainable& t = trainables_[2 * i + size_t(which)];
        const Shape& shape = which == 0 ? ad.a_shape : ad.b_shape;
        t.region = whole_shard_spec(right_aligned_dimensions(shape.size()), shape);
        t.shard = make_shard_spec(right_aligned_dimensions(shape.size()), shape,
                                  dist_.layout.resolve(params_[2 * i + size_t(which)].path, shape, mesh), mesh);
        t.partial = plan_.active();
      }
    }
  } else {
    // Full fine-tuning: every variable's block (the optimizer's) and fp32 working copy (its compute
    // region), read from the stored weights — or from the block sharded loading left there.
    const auto specs = gemma_variables(config_);
    for (size_t i = 0; i < specs.size(); ++i) {
      const VariableSpec& spec = specs[i];
      Trainable& t = trainables_[i];
      t.shard = make_shard_spec(our_dimensions(spec.kind), spec.keras_shape,
                                dist_.layout.resolve(spec.keras_path, spec.keras_shape, mesh), mesh);
      t.region = plan_.compute_region(spec);
      t.partial = plan_.gradient_is_partial(spec);
      std::vector<float> working;
      if (holds_only_block(model_, spec, t.shard)) {
        std::vector<float> block = variable_values(model_, spec);
        working = gather_region(block.data(), t.shard, t.region, mesh);
        if (t.separate()) t.block = std::move(block);
      } else {
        if (t.separate()) t.block = read_block(model_, spec, t.shard);
        working = read_block(model_, spec, t.region);
      }
      set_variable(model_, spec, t.region, std::move(working));
      SlotRef ref = slot_ref(model_, grads_, spec);
      grad_storage_[i].assign(ref.size, 0.f);
      *ref.grad = grad_storage_[i].data();
      t.value = ref.value;
      t.grad = grad_storage_[i].data();
      t.size = ref.size;
    }
    model_.config = plan_.local_config(config_);
    if (plan_.active()) {
      model_.tensor_parallel = &mesh.axis_comm(plan_.axis);
      model_.vocab_offset = plan_.vocab_offset(config_);
    }
  }
  // The optimizer sees blocks where they are separate, else the working copies.
  for (size_t i = 0; i < params_.size(); ++i) {
    Trainable& t = trainables_[i];
    const ShardSpec& held = t.held();
    if (t.separate()) t.block_grad.assign(t.block.size(), 0.f);
    params_[i].value = t.separate() ? t.block.data() : t.value;
    params_[i].grad = t.separate() ? t.block_grad.data() : t.grad;
    params_[i].size = size_t(held.local_size());
    if (held.local_size() != held.full_size()) params_[i].shape = {held.local[0], held.local[1], held.local[2]};
  }
}

void Trainer::refresh_working_copy(Trainable& t) {
  if (!t.separate()) return;
  const std::vector<float> values = gather_region(t.block.data(), t.shard, t.region, *dist_.mesh);
  std::copy(values.begin(), values.end(), t.value);
}

bool Trainer::is_main_process() const { return !dist_.mesh || dist_.mesh->comm().rank() == 0; }

size_t Trainer::held_weight_bytes() const {
  if (lora_) return dist_.mesh ? frozen_.held_bytes() : model_.weight_bytes();
  size_t bytes = 0;  // full fine-tuning: the working copies, and the blocks the optimizer owns
  for (const Trainable& t : trainables_) bytes += (t.size + t.block.size()) * 4;
  return bytes;
}

Batch Trainer::local_rows(const Batch& batch) const {
  if (!dist_.mesh) return batch;
  const int axis = dist_.mesh->axis_index(dist_.batch_axis);
  if (axis < 0 || dist_.mesh->axis_size(axis) == 1) return batch;
  const int64_t parts = dist_.mesh->axis_size(axis), c = dist_.mesh->coordinate(axis);
  check(batch.batch_size % parts == 0, "batch of ", batch.batch_size, " examples is not divisible by the '",
        dist_.batch_axis, "' mesh axis of size ", parts, " (choose --batch-size as a multiple of it)");
  const int64_t rows = batch.batch_size / parts, L = batch.seq_len;
  Batch local;
  local.batch_size = rows;
  local.seq_len = L;
  auto slice = [&](const auto& v) { return std::vector(v.begin() + c * rows * L, v.begin() + (c + 1) * rows * L); };
  local.token_ids = slice(batch.token_ids);
  local.padding_mask = slice(batch.padding_mask);
  local.targets = slice(batch.targets);
  local.sample_weight = slice(batch.sample_weight);
  return local;
}

// Sums the given arrays over `comm` with one collective per bucket of up to 16 Mi floats rather than
// one per array (LoRA has two small arrays per adapter: latency, not bandwidth, would dominate).
static void sum_in_buckets(Communicator& comm, const std::vector<std::pair<float*, size_t>>& arrays) {
  constexpr size_t kBucket = size_t(1) << 24;
  std::vector<float> bucket;
  std::vector<std::pair<float*, size_t>> members;
  auto flush = [&] {
    if (bucket.empty()) return;
    comm.all_reduce_sum(bucket.data(), bucket.size());
    size_t o = 0;
    for (const auto& [data, n] : members) {
      std::copy_n(bucket.begin() + long(o), n, data);
      o += n;
    }
    bucket.clear();
    members.clear();
  };
  for (const auto& [data, n] : arrays) {
    if (n >= kBucket) {  // large arrays go on their own, in place
      comm.all_reduce_sum(data, n);
      continue;
    }
    if (bucket.size() + n > kBucket) flush();
    bucket.insert(bucket.end(), data, data + n);
    members.push_back({data, n});
  }
  flush();
}

// The dimension of `t`'s working copy that its block splits over mesh axis `axis` — when that is
// the only split between them (then a reduce-scatter over the axis yields the block directly) — else -1.
static int only_split_by(const ShardSpec& region, const ShardSpec& shard, int axis) {
  if (!contains(region, shard)) return -1;
  const ShardSpec inside = relative(shard, region);
  int dim = -1;
  for (int d = 0; d < 3; ++d) {
    if (inside.axis[size_t(d)] < 0) continue;
    if (inside.axis[size_t(d)] != axis || dim >= 0) return -1;
    dim = d;
  }
  return dim;
}

void Trainer::finish_gradients(LossSums& sums) {
  if (!dist_.mesh) return;
  const int axis = dist_.mesh->axis_index(dist_.batch_axis);
  Communicator* batch = axis >= 0 && dist_.mesh->axis_size(axis) > 1 ? &dist_.mesh->axis_comm(axis) : nullptr;
  // Gradients whose block splits the working copy over the batch axis only are reduce-scattered
  // (FSDP-style: each process receives just its block's sums); the others are all-reduced.
  std::vector<int> scatter_dim(trainables_.size(), -1);
  if (batch) {
    double s[3] = {sums.weighted_ce, sums.weighted_correct, sums.weight};
    batch->all_reduce_sum(s, 3);
    sums = {s[0], s[1], s[2]};
    std::vector<std::pair<float*, size_t>> grads;
    for (size_t i = 0; i < trainables_.size(); ++i) {
      Trainable& t = trainables_[i];
      scatter_dim[i] = t.separate() ? only_split_by(t.region, t.shard, axis) : -1;
      if (scatter_dim[i] < 0) grads.push_back({t.grad, t.size});
    }
    sum_in_buckets(*batch, grads);
  }
  Communicator* tensor_parallel = plan_.active() ? &dist_.mesh->axis_comm(plan_.axis) : nullptr;
  if (tensor_parallel) {  // partial gradients of parts this process holds whole: one bucketed sum
    std::vector<std::pair<float*, size_t>> partial;
    for (Trainable& t : trainables_)
      if (t.partial && contains(t.region, t.shard)) partial.push_back({t.grad, t.size});
    sum_in_buckets(*tensor_parallel, partial);
  }
  for (size_t i = 0; i < trainables_.size(); ++i) {
    Trainable& t = trainables_[i];
    if (tensor_parallel && !contains(t.region, t.shard)) {
      // The block reaches beyond this process' part (e.g. a replicated K/V kernel of which each
      // process uses its heads): assemble the whole gradient from every process' part.
      std::vector<float> whole(static_cast<size_t>(t.shard.full_size()), 0.f);
      place_block(t.grad, t.region, whole.data());
      tensor_parallel->all_reduce_sum(whole.data(), whole.size());
      t.block_grad = take_block(whole.data(), t.shard);
    } else if (scatter_dim[i] >= 0) {
      // Every member's block, in member order, then one reduce-scatter.
      ShardSpec member = relative(t.shard, t.region);
      const size_t count = size_t(member.local_size());
      std::vector<float> blocks(count * size_t(batch->size()));
      for (int m = 0; m < batch->size(); ++m) {
        member.offset[size_t(scatter_dim[i])] = member.local[size_t(scatter_dim[i])] * m;
        const std::vector<float> b = take_block(t.grad, member);
        std::copy(b.begin(), b.end(), blocks.begin() + long(count * size_t(m)));
      }
      t.block_grad.resize(count);
      batch->reduce_scatter_sum(blocks.data(), count, t.block_grad.data());
    } else if (t.separate()) {
      t.block_grad = take_block(t.grad, relative(t.shard, t.region));
    }
    if (t.separate()) params_[i].grad = t.block_grad.data();  // take_block reallocated it
  }
}

void Trainer::apply_update(double lr) {
  optimizer_->step(params_, lr);
  ++step_;
  if (!dist_.mesh) return;
  for (Trainable& t : trainables_) refresh_working_copy(t);
}

long long Trainer::trainable_count() const {
  long long n = 0;
  for (const Trainable& t : trainables_) n += (long long)t.whole_size;  // whole tensors, not blocks
  return n;
}

GemmaModel Trainer::current_model() {
  if (lora_) return merge_lora(frozen_.has_split() ? frozen_.materialize() : model_, *lora_);
  if (!plan_.active()) return model_;  // whole working copies
  GemmaModel m = model_;  // tensor parallel: each variable gathered from its parts
  m.config = config_;
  m.tensor_parallel = nullptr;
  m.vocab_offset = 0;
  const auto specs = gemma_variables(config_);
  for (size_t i = 0; i < specs.size(); ++i) {
    const Trainable& t = trainables_[i];
    std::vector<float> whole(t.whole_size);
    gather_full(t.separate() ? t.block.data() : t.value, t.shard, *dist_.mesh, whole.data());
    set_variable(m, specs[i], std::move(whole));
  }
  return m;
}

GemmaModel Trainer::training_model() {
  // The frozen base as computed here (under a mesh: this process' heads/FFN columns, the other
  // split variables all-gathered one block at a time as the passes reach them), with the adapters
  // as low-rank terms: nothing is merged.
  GemmaModel m = dist_.mesh ? frozen_.compute_model(/*by_layer=*/true) : model_;
  attach_lora(m, *lora_, config_, plan_);
  return m;
}

GemmaModel Trainer::inference_model() {
  if (!dist_.mesh) return current_model();
  if (!lora_) return model_;  // the working copies (this process' parts under tensor parallelism)
  return merge_lora_parts(frozen_.compute_model(/*by_layer=*/false), *lora_, config_, plan_);
}

void Trainer::zero_gradients() {
  for (Trainable& t : trainables_) std::fill(t.grad, t.grad + t.size, 0.f);
}

void Trainer::accumulate_gradients(const Batch& global_batch, double loss_scale, LossSums& sums) {
  const Batch batch = local_rows(global_batch);
  TokenBatch tb{batch.batch_size, batch.seq_len, batch.token_ids.data(), batch.padding_mask.data(),
                batch.targets.data(), batch.sample_weight.data()};
  // Full fine-tuning: into the weights' gradients; LoRA: into the adapters' grad_a / grad_b.
  const LossSums s = lora_ ? forward_backward(training_model(), tb, loss_scale, &grads_, &workspace_)
                          : forward_backward(model_, tb, loss_scale, &grads_, &workspace_);
  sums.weighted_ce += s.weighted_ce;
  sums.weighted_correct += s.weighted_correct;
  sums.weight += s.weight;
}

LossSums Trainer::train_step(const Batch& batch, double learning_rate) {
  zero_gradients();
  LossSums sums;
  accumulate_gradients(batch, 1.0 / double(batch.batch_size * batch.seq_len), sums);
  finish_gradients(sums);
  apply_update(learning_rate);
  return sums;
}

EpochMetrics Trainer::evaluate(const BatchStream& data) {
  GemmaModel m = inference_model();
  double loss_sum = 0, examples = 0, correct = 0, weight = 0;
  for (size_t s = 0; s < data.steps_per_epoch(); ++s) {
    Batch batch = data.batch(0, s);
    TokenBatch tb{batch.batch_size, batch.seq_len, batch.token_ids.data(), batch.padding_mask.data(),
                  batch.targets.data(), batch.sample_weight.data()};
    LossSums sums = forward_backward(m, tb, 1.0, nullptr);
    loss_sum += sums.weighted_ce / double(batch.seq_len);  // = batch loss × B
    examples += double(batch.batch_size);
    correct += sums.weighted_correct;
    weight += sums.weight;
  }
  return {examples > 0 ? loss_sum / examples : 0, weight > 0 ? correct / weight : 0};
}

EpochMetrics Trainer::fit(const BatchStream& data, const std::atomic<bool>* stop_requested) {
  const int64_t k = std::max(1, options_.grad_accumulation);
  const int64_t batches = int64_t(data.steps_per_epoch());
  const int64_t steps_per_epoch = (batches + k - 1) / k;
  // By steps (epochs 0): N optimizer steps over as many epochs as that takes, one progress bar of N.
  const bool by_steps = options_.epochs == 0;
  check(!by_steps || options_.max_steps > 0, "fit: epochs 0 needs max_steps");
  int64_t total_steps = by_steps ? options_.max_steps : steps_per_epoch * options_.epochs;
  if (options_.max_steps > 0) total_steps = std::min(total_steps, options_.max_steps);
  const bool main_process = is_main_process();
  std::FILE* log = options_.log_jsonl.empty() || !main_process ? nullptr : std::fopen(options_.log_jsonl.c_str(), step_ > 0 ? "a" : "w");
  check(options_.log_jsonl.empty() || !main_process || log, options_.log_jsonl, ": cannot open for writing");
  EpochMetrics metrics{epoch_examples_ > 0 ? epoch_loss_sum_ / epoch_examples_ : 0,
                       epoch_weight_ > 0 ? epoch_correct_ / epoch_weight_ : 0};
  const bool terminal = isatty(fileno(stderr));
  std::unique_ptr<ProgressBar> run_bar;  // by steps: one bar over the whole run
  if (by_steps && options_.progress && main_process && step_ < total_steps) {
    run_bar = std::make_unique<ProgressBar>(total_steps, stderr, terminal);
  }

  while (step_ < total_steps) {
    const int64_t epoch = step_ / steps_per_epoch, first = step_ % steps_per_epoch;
    if (first == 0) epoch_loss_sum_ = epoch_examples_ = epoch_correct_ = epoch_weight_ = 0;
    if (options_.epochs > 1 && options_.progress && main_process) std::fprintf(stderr, "Epoch %lld/%d\n", (long long)epoch + 1, options_.epochs);
    const int64_t last = std::min(steps_per_epoch, total_steps - epoch * steps_per_epoch);
    std::unique_ptr<ProgressBar> bar;  // by epochs: one bar per epoch, as Keras' fit
    if (!by_steps && options_.progress && main_process) bar = std::make_unique<ProgressBar>(last, stderr, terminal);
    for (int64_t s = first; s < last; ++s) {
      auto t0 = std::chrono::steady_clock::now();
      zero_gradients();
      const int64_t b0 = s * k, b1 = std::min(batches, b0 + k);
      LossSums sums;
      double examples = 0, tokens = 0;
      int64_t seq_len = 1;
      for (int64_t b = b0; b < b1; ++b) {
        Batch batch = data.batch(size_t(epoch), size_t(b));
        accumulate_gradients(batch, 1.0 / double(batch.batch_size * batch.seq_len * (b1 - b0)), sums);
        examples += double(batch.batch_size);
        tokens += double(batch.batch_size * batch.seq_len);
        seq_len = batch.seq_len;
      }
      finish_gradients(sums);  // sums now cover the whole (global) batch
      const double batch_loss_times_b = sums.weighted_ce / double(seq_len);  // (Σw·CE/(B·T))·B
      const double lr = options_.schedule.at(step_);
      apply_update(lr);
      epoch_loss_sum_ += batch_loss_times_b;
      epoch_examples_ += examples;
      epoch_correct_ += sums.weighted_correct;
      epoch_weight_ += sums.weight;
      metrics = {epoch_loss_sum_ / epoch_examples_, epoch_weight_ > 0 ? epoch_correct_ / epoch_weight_ : 0};
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (bar) bar->update(s + 1, {{"loss", metrics.loss}, {"sparse_categorical_accuracy", metrics.accuracy}});
      if (run_bar) run_bar->update(step_, {{"loss", metrics.loss}, {"sparse_categorical_accuracy", metrics.accuracy}});
      if (log) {
        json line = {{"step", step_}, {"epoch", epoch + 1}, {"loss", batch_loss_times_b / examples},
                     {"epoch_loss", metrics.loss}, {"accuracy", metrics.accuracy}, {"learning_rate", lr},
                     {"tokens_per_s", tokens / seconds}, {"ms_per_step", seconds * 1e3}};
        std::fprintf(log, "%s\n", line.dump().c_str());
        std::fflush(log);
      }
      bool stop = stop_requested && stop_requested->load();
      if (dist_.mesh && dist_.mesh->size() > 1) {  // every process stops at the same step
        double any = stop ? 1 : 0;
        dist_.mesh->comm().all_reduce_sum(&any, 1);
        stop = any > 0;
      }
      if (!options_.checkpoint_path.empty() &&
          (stop || (options_.checkpoint_every > 0 && step_ % options_.checkpoint_every == 0)))
        save_checkpoint(options_.checkpoint_path);
      if (options_.kill_after_step > 0 && step_ == options_.kill_after_step) std::raise(SIGKILL);
      if (stop) {
        interrupted_ = true;
        if (log) std::fclose(log);
        if (bar || run_bar) std::fprintf(stderr, "\n");
        return metrics;
      }
    }
  }
  if (log) std::fclose(log);
  if (!options_.checkpoint_path.empty()) save_checkpoint(options_.checkpoint_path);
  return metrics;
}

// ---- checkpoints: one safetensors file, written atomically ------------------------------------

static std::string exact(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

static HostTensor view_of(const float* data, size_t n) {
  HostTensor t;
  t.dtype = DType::F32;
  t.shape = {int64_t(n)};
  t.data = reinterpret_cast<const std::byte*>(data);
  return t;
}

std::string Trainer::checkpoint_file(const std::string& path) const {
  if (!dist_.mesh || dist_.mesh->size() == 1) return path;
  return path + ".step" + std::to_string(step_) + ".rank" + std::to_string(dist_.mesh->comm().rank());
}

void Trainer::save_checkpoint(const std::string& path) const {
  std::vector<std::pair<std::string, HostTensor>> tensors;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = params_[i];
    tensors.emplace_back("param/" + p.path, view_of(p.value, p.size));
    tensors.emplace_back("momentum/" + p.path, view_of(optimizer_->momentums[i].data(), p.size));
    tensors.emplace_back("velocity/" + p.path, view_of(optimizer_->velocities[i].data(), p.size));
  }
  std::map<std::string, std::string> meta = {
      {"format", "meshtune-checkpoint-1"},
      {"mode", lora_ ? "lora" : "full"},
      {"step", std::to_string(step_)},
      {"iterations", std::to_string(optimizer_->iterations)},
      {"epoch_loss_sum", exact(epoch_loss_sum_)},
      {"epoch_examples", exact(epoch_examples_)},
      {"epoch_correct", exact(epoch_correct_)},
      {"epoch_weight", exact(epoch_weight_)},
      {"lora_rank", std::to_string(lora_ ? lora_->rank : 0)},
      {"lora_alpha", exact(lora_ ? lora_->alpha : 0)},
  };
  if (dist_.mesh) {  // where each block lies in its whole variable, so `export` can reassemble them
    json placement = json::object();
    for (size_t i = 0; i < params_.size(); ++i) {
      const ShardSpec& held = trainables_[i].held();
      placement[params_[i].path] = {{"full", held.full}, {"local", held.local}, {"offset", held.offset}};
    }
    meta["placement"] = placement.dump();
  }
  write_safetensors(checkpoint_file(path), tensors, meta);
  if (!dist_.mesh || dist_.mesh->size() == 1) return;
  // Sharded: every rank has written its file; rank 0 then switches the manifest to this step
  // (atomically), and each rank removes its file of the previous checkpoint.
  DeviceMesh& mesh = *dist_.mesh;
  mesh.comm().barrier();
  if (mesh.comm().rank() == 0) {
    json manifest = {{"format", "meshtune-sharded-checkpoint-1"}, {"step", step_}, {"mesh", mesh.shape()},
                     {"axes", mesh.axis_names()}, {"files", json::array()}};
    for (int r = 0; r < mesh.size(); ++r)
      manifest["files"].push_back(fs::path(path + ".step" + std::to_string(step_) + ".rank" + std::to_string(r)).filename().string());
    write_file_atomic(path, manifest.dump(2));
  }
  mesh.comm().barrier();
  for (const auto& entry : fs::directory_iterator(fs::path(path).parent_path().empty() ? "." : fs::path(path).parent_path())) {
    const std::string name = entry.path().filename().string(), base = fs::path(path).filename().string();
    const std::string mine = ".rank" + std::to_string(mesh.comm().rank());
    if (name.rfind(base + ".step", 0) == 0 && name.size() > mine.size() &&
        name.compare(name.size() - mine.size(), mine.size(), mine) == 0 && entry.path().string() != checkpoint_file(path))
      fs::remove(entry.path());
  }
}

// A sharded checkpoint's manifest (rank 0 writes it last): the mesh and every rank's file, each a
// plain name inside the run directory.
struct CheckpointManifest {
  std::vector<int64_t> mesh;
  std::vector<std::string> files;  // full paths, one per rank
};

// Whether `path` is a manifest (JSON) rather than a safetensors file, from its first byte.
static bool is_manifest(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check(bool(in), path, ": cannot open checkpoint: ", std::strerror(errno));
  char first = 0;
  return in.get(first) && first == '{';
}

static CheckpointManifest read_manifest(const std::string& path) {
  const json doc = read_json_file(path);
  const JsonValue root(doc, path);
  check(root.is_object() && root.string_or("format", "") == "meshtune-sharded-checkpoint-1", path,
        ": not a meshtune sharded-checkpoint manifest");
  CheckpointManifest m;
  const JsonValue mesh = root["mesh"];
  for (const JsonValue& d : mesh.elements()) m.mesh.push_back(d.integer(1, 1 << 20));
  int64_t processes = 1;
  for (int64_t d : m.mesh) check(!__builtin_mul_overflow(processes, d, &processes) && processes <= (1 << 20), mesh.where(), ": too many processes");
  const JsonValue files = root["files"];
  check(int64_t(files.size()) == processes, files.where(), ": lists ", files.size(), " files for a mesh of ", processes,
        " processes");
  const std::string dir = fs::path(path).parent_path().string();
  for (const JsonValue& f : files.elements()) m.files.push_back(plain_file_in(dir, f.string(), f.where()));
  return m;
}

// The files of a checkpoint: the file itself, or every rank's file named by a sharded manifest.
static std::vector<std::string> checkpoint_files(const std::string& manifest_or_file) {
  if (!is_manifest(manifest_or_file)) return {manifest_or_file};
  return read_manifest(manifest_or_file).files;
}

// The checkpoint metadata of one file: strings, with the numbers checked.
struct CheckpointMetadata {
  std::string file;
  std::map<std::string, std::string> values;

  explicit CheckpointMetadata(const std::string& path) : file(path) {
    std::error_code ec;
    check(fs::is_regular_file(path, ec), path, ": checkpoint file is missing");
    values = read_safetensors_metadata(path);
    check(text("format") == "meshtune-checkpoint-1", path, ": not a meshtune checkpoint");
  }
  std::string text(const std::string& key) const {
    auto it = values.find(key);
    return it == values.end() ? std::string() : it->second;
  }
  int64_t integer(const std::string& key, int64_t lo, int64_t hi) const {
    const std::string t = text(key);
    int64_t v = 0;
    const auto [end, err] = std::from_chars(t.data(), t.data() + t.size(), v);
    check(!t.empty() && err == std::errc() && end == t.data() + t.size() && v >= lo && v <= hi, file, ": metadata ",
          key, " must be an integer in [", lo, ", ", hi, "], got \"", brief(t), "\"");
    return v;
  }
  double number(const std::string& key) const {
    const std::string t = text(key);
    char* end = nullptr;
    const double v = t.empty() ? 0 : std::strtod(t.c_str(), &end);
    check(!t.empty() && end == t.c_str() + t.size() && std::isfinite(v), file, ": metadata ", key,
          " must be a number, got \"", brief(t), "\"");
    return v;
  }
};

// Where a file's block of `path` lies in the whole variable (as save_checkpoint records it),
// checked: every extent positive, the block inside the variable.
static ShardSpec read_placement(const JsonValue& p) {
  ShardSpec block;
  const std::vector<int64_t> full = p["full"].integers(3, 1, int64_t(1) << 34);
  const std::vector<int64_t> local = p["local"].integers(3, 1, int64_t(1) << 34);
  const std::vector<int64_t> offset = p["offset"].integers(3, 0, int64_t(1) << 34);
  for (size_t d = 0; d < 3; ++d) {
    check(local[d] <= full[d] && offset[d] <= full[d] - local[d], p.where(), ": block [", offset[d], ", ",
          offset[d] + local[d], ") of dimension ", d, " lies outside the variable's ", full[d]);
    block.full[d] = full[d];
    block.local[d] = local[d];
    block.offset[d] = offset[d];
  }
  int64_t size = 1;
  for (int64_t d : full)
    check(!__builtin_mul_overflow(size, d, &size) && size <= (int64_t(1) << 34), p.where(), ": full ",
          json(full).dump(), " is implausibly large");
  return block;
}

TrainedParameters read_trained_parameters(const std::string& manifest_or_file) {
  TrainedParameters out;
  const std::vector<std::string> files = checkpoint_files(manifest_or_file);
  std::map<std::string, std::vector<ShardSpec>> blocks;  // per sharded variable: its distinct blocks
  std::map<std::string, std::string> first_file;
  for (const std::string& file : files) {
    const CheckpointMetadata meta(file);
    out.mode = meta.text("mode");
    check(out.mode == "lora" || out.mode == "full", file, ": metadata mode must be lora or full, got \"",
          brief(out.mode), "\"");
    out.step = meta.integer("step", 0, int64_t(1) << 50);
    out.lora_rank = int(meta.integer("lora_rank", 0, 1 << 20));
    out.lora_alpha = meta.number("lora_alpha");
    const std::string placement_text = meta.text("placement");
    const json placement_doc = parse_json(placement_text.empty() ? "{}" : placement_text, file + ": metadata placement");
    const JsonValue placement(placement_doc, file, "placement");
    check(placement.is_object(), placement.where(), ": must be an object");
    for (const auto& [name, tensor] : read_safetensors(file)) {
      if (name.rfind("param/", 0) != 0) continue;
      const std::string path = name.substr(6);
      check(tensor.dtype == DType::F32, file, ": ", brief(name), " must be F32, got ", dtype_name(tensor.dtype));
      if (!placement.has(path)) {  // a single-process checkpoint: the whole variable
        check(files.size() == 1, file, ": ", brief(path), " has no placement, but the checkpoint has ", files.size(), " files");
        out.values[path] = to_f32(tensor);
        continue;
      }
      const ShardSpec block = read_placement(placement[path]);  // this file's block of the variable
      check(num_elements(tensor.shape) == block.local_size(), file, ": ", brief(path), " holds ",
            num_elements(tensor.shape), " values, its placement says ", block.local_size());
      // Blocks of one variable cover it; so the whole is at most (blocks × block size), bounded by the files.
      check(block.full_size() <= block.local_size() * int64_t(files.size()), placement[path].where(),
            ": a variable of ", block.full_size(), " values cannot be made of ", files.size(), " blocks of ",
            block.local_size());
      std::vector<float>& whole = out.values[path];
      if (whole.empty()) {
        whole.assign(size_t(block.full_size()), 0.f);
        first_file[path] = file;
      }
      check(blocks[path].empty() || block.full == blocks[path][0].full, placement[path].where(),
            ": the variable's shape differs from its shape in ", first_file[path]);
      // Replicated blocks repeat (same region in several files); distinct blocks must not overlap.
      bool repeat = false;
      for (const ShardSpec& other : blocks[path]) {
        if (same_region(other, block)) repeat = true;
        else check(!overlaps(other, block), placement[path].where(), ": block overlaps another block of the variable");
      }
      const std::vector<float> values = to_f32(tensor);
      place_block(values.data(), block, whole.data());
      if (!repeat) blocks[path].push_back(block);
    }
  }
  for (const auto& [path, parts] : blocks) {  // distinct, non-overlapping blocks: they cover it iff sizes add up
    int64_t covered = 0;
    for (const ShardSpec& b : parts) covered += b.local_size();
    check(covered == parts[0].full_size(), manifest_or_file, ": the blocks of ", brief(path), " cover ", covered, " of ",
          parts[0].full_size(), " values (a rank file is missing or its placement is wrong)");
  }
  return out;
}

void Trainer::load_checkpoint(const std::string& manifest_or_file) {
  std::string path = manifest_or_file;
  const int processes = dist_.mesh ? dist_.mesh->size() : 1;
  if (is_manifest(manifest_or_file)) {
    const CheckpointManifest manifest = read_manifest(manifest_or_file);
    const std::vector<int64_t> this_mesh = dist_.mesh ? std::vector<int64_t>(dist_.mesh->shape().begin(), dist_.mesh->shape().end())
                                                     : std::vector<int64_t>{1};
    check(processes > 1 && manifest.mesh == this_mesh, manifest_or_file, ": a sharded checkpoint of mesh ",
          json(manifest.mesh).dump(), "; resume it on that mesh (this run: ",
          dist_.mesh ? json(dist_.mesh->shape()).dump() : std::string("one process"), ")");
    path = manifest.files[size_t(dist_.mesh->comm().rank())];
  } else {
    check(processes == 1, manifest_or_file, ": a single-process checkpoint; resume it without a mesh");
  }
  const CheckpointMetadata meta(path);
  std::map<std::string, HostTensor> tensors = read_safetensors(path);
  check(meta.text("mode") == (lora_ ? "lora" : "full"), path, ": checkpoint is for ", brief(meta.text("mode")),
        " training, this run is ", lora_ ? "lora" : "full");
  for (size_t i = 0; i < params_.size(); ++i) {
    const Parameter& p = params_[i];
    for (const std::string kind : {"param/", "momentum/", "velocity/"}) {
      auto it = tensors.find(kind + p.path);
      check(it != tensors.end(), path, ": missing ", kind + p.path, " (was the checkpoint made with other options?)");
      check(it->second.dtype == DType::F32 && size_t(num_elements(it->second.shape)) == p.size, path, ": ",
            kind + p.path, " has ", num_elements(it->second.shape), " values, expected ", p.size);
      float* dst = kind == "param/" ? p.value : kind == "momentum/" ? optimizer_->momentums[i].data()
                                                                     : optimizer_->velocities[i].data();
      std::memcpy(dst, it->second.data, p.size * 4);
    }
  }
  step_ = meta.integer("step", 0, int64_t(1) << 50);
  optimizer_->iterations = meta.integer("iterations", 0, int64_t(1) << 50);
  epoch_loss_sum_ = meta.number("epoch_loss_sum");
  epoch_examples_ = meta.number("epoch_examples");
  epoch_correct_ = meta.number("epoch_correct");
  epoch_weight_ = meta.number("epoch_weight");
  // Working copies follow the restored blocks.
  if (dist_.mesh)
    for (Trainable& t : trainables_) refresh_working_copy(t);
}

}  // namespace meshtune
