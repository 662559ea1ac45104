#include "train/trainer.h"

#include <unistd.h>

#include <csignal>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/variables.h"
#include "train/progress.h"

namespace meshtune {

using json = nlohmann::json;

// A writable fp32 copy of a matrix (full fine-tuning updates weights in place).
static WeightMatrix writable_copy(const WeightMatrix& m) {
  auto data = std::make_shared<std::vector<float>>(static_cast<size_t>(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r) m.row_to_f32(r, data->data() + r * m.cols);
  WeightMatrix out;
  out.rows = m.rows;
  out.cols = m.cols;
  out.dtype = DType::F32;
  out.data = data->data();
  out.owner = data;
  return out;
}

// The value storage of a variable and the gradient pointer that backward fills for it.
struct SlotRef {
  float* value = nullptr;
  size_t size = 0;
  float** grad = nullptr;
};

static SlotRef slot_ref(GemmaModel& m, ModelGradients& g, const VariableSpec& spec) {
  auto matrix = [](WeightMatrix& w, float*& grad) {
    return SlotRef{const_cast<float*>(w.f32()), size_t(w.rows * w.cols), &grad};
  };
  auto vec = [](std::vector<float>& v, float*& grad) { return SlotRef{v.data(), v.size(), &grad}; };
  if (spec.slot == Slot::Embeddings) return matrix(m.embeddings, g.embeddings);
  if (spec.slot == Slot::FinalNorm) return vec(m.final_norm, g.final_norm);
  DecoderLayerWeights& l = m.layers[size_t(spec.layer)];
  LayerGradients& lg = g.layers[size_t(spec.layer)];
  switch (spec.slot) {
    case Slot::PreAttentionNorm: return vec(l.pre_attention_norm, lg.pre_attention_norm);
    case Slot::PostAttentionNorm: return vec(l.post_attention_norm, lg.post_attention_norm);
    case Slot::PreFfwNorm: return vec(l.pre_ffw_norm, lg.pre_ffw_norm);
    case Slot::PostFfwNorm: return vec(l.post_ffw_norm, lg.post_ffw_norm);
    case Slot::QueryNorm: return vec(l.query_norm, lg.query_norm);
    case Slot::KeyNorm: return vec(l.key_norm, lg.key_norm);
    case Slot::Query: return matrix(l.query, lg.query);
    case Slot::Key: return matrix(l.key, lg.key);
    case Slot::Value: return matrix(l.value, lg.value);
    case Slot::AttentionOutput: return matrix(l.attention_output, lg.attention_output);
    case Slot::FfwGating: return matrix(l.ffw_gating, lg.ffw_gating);
    case Slot::FfwGating2: return matrix(l.ffw_gating_2, lg.ffw_gating_2);
    case Slot::FfwLinear: return matrix(l.ffw_linear, lg.ffw_linear);
    default: break;
  }
  fail("unknown variable slot");
}

static std::string short_name(const std::string& path) { return path.substr(path.rfind('/') + 1); }

Trainer::Trainer(GemmaModel base, std::optional<LoraWeights> lora, const FitOptions& options)
    : model_(std::move(base)), lora_(std::move(lora)), options_(options) {
  const GemmaConfig& c = model_.config;
  grads_.layers.assign(size_t(c.num_layers), LayerGradients{});
  if (lora_ && lora_->adapters.empty()) lora_.reset();
  if (lora_) {
    validate_lora(c, *lora_, "LoRA adapter");
    lora_weight_grads_.resize(lora_->adapters.size());
    for (size_t i = 0; i < lora_->adapters.size(); ++i) {
      LoraAdapter& ad = lora_->adapters[i];
      ad.grad_a.assign(ad.a.size(), 0.f);
      ad.grad_b.assign(ad.b.size(), 0.f);
      VariableSpec target;
      for (const VariableSpec& spec : gemma_variables(c))
        if (spec.layer == ad.layer && spec.slot == ad.slot) target = spec;
      lora_weight_grads_[i].assign(size_t(num_elements(target.hf_shape)), 0.f);
      SlotRef ref = slot_ref(model_, grads_, target);
      *ref.grad = lora_weight_grads_[i].data();
      const std::string path = ad.keras_path(c);
      params_.push_back({path + "/lora_kernel_a", "lora_kernel_a", ad.a_shape, ad.a.data(), ad.grad_a.data(), ad.a.size()});
      params_.push_back({path + "/lora_kernel_b", "lora_kernel_b", ad.b_shape, ad.b.data(), ad.grad_b.data(), ad.b.size()});
    }
  } else {
    model_.embeddings = writable_copy(model_.embeddings);
    for (auto& l : model_.layers)
      for (WeightMatrix* w : {&l.query, &l.key, &l.value, &l.attention_output, &l.ffw_gating, &l.ffw_gating_2, &l.ffw_linear})
        *w = writable_copy(*w);
    const auto specs = gemma_variables(c);
    grad_storage_.resize(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      SlotRef ref = slot_ref(model_, grads_, specs[i]);
      grad_storage_[i].assign(ref.size, 0.f);
      *ref.grad = grad_storage_[i].data();
      params_.push_back({specs[i].keras_path, short_name(specs[i].keras_path), specs[i].hf_shape, ref.value,
                         grad_storage_[i].data(), ref.size});
    }
  }
  optimizer_ = std::make_unique<AdamW>(options_.adamw, params_);
}

long long Trainer::trainable_count() const {
  long long n = 0;
  for (const Parameter& p : params_) n += (long long)p.size;
  return n;
}

GemmaModel Trainer::current_model() const { return lora_ ? merge_lora(model_, *lora_) : model_; }

void Trainer::zero_gradients() {
  for (const Parameter& p : params_) std::fill(p.grad, p.grad + p.size, 0.f);
}

void Trainer::accumulate_gradients(const Batch& batch, double loss_scale, LossSums& sums) {
  TokenBatch tb{batch.batch_size, batch.seq_len, batch.token_ids.data(), batch.padding_mask.data(),
                batch.targets.data(), batch.sample_weight.data()};
  if (!lora_) {
    LossSums s = forward_backward(model_, tb, loss_scale, &grads_);
    sums.weighted_ce += s.weighted_ce;
    sums.weighted_correct += s.weighted_correct;
    sums.weight += s.weight;
    return;
  }
  for (auto& g : lora_weight_grads_) std::fill(g.begin(), g.end(), 0.f);
  GemmaModel merged = merge_lora(model_, *lora_);
  LossSums s = forward_backward(merged, tb, loss_scale, &grads_);
  for (size_t i = 0; i < lora_->adapters.size(); ++i)
    lora_backward(model_.config, lora_->adapters[i], lora_->scale(), lora_weight_grads_[i].data());
  sums.weighted_ce += s.weighted_ce;
  sums.weighted_correct += s.weighted_correct;
  sums.weight += s.weight;
}

LossSums Trainer::train_step(const Batch& batch, double learning_rate) {
  zero_gradients();
  LossSums sums;
  accumulate_gradients(batch, 1.0 / double(batch.batch_size * batch.seq_len), sums);
  optimizer_->step(params_, learning_rate);
  ++step_;
  return sums;
}

EpochMetrics Trainer::evaluate(const BatchStream& data) {
  GemmaModel m = current_model();
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
  int64_t total_steps = steps_per_epoch * options_.epochs;
  if (options_.max_steps > 0) total_steps = std::min(total_steps, options_.max_steps);
  std::FILE* log = options_.log_jsonl.empty() ? nullptr : std::fopen(options_.log_jsonl.c_str(), step_ > 0 ? "a" : "w");
  check(options_.log_jsonl.empty() || log, options_.log_jsonl, ": cannot open for writing");
  EpochMetrics metrics{epoch_examples_ > 0 ? epoch_loss_sum_ / epoch_examples_ : 0,
                       epoch_weight_ > 0 ? epoch_correct_ / epoch_weight_ : 0};
  const bool terminal = isatty(fileno(stderr));

  while (step_ < total_steps) {
    const int64_t epoch = step_ / steps_per_epoch, first = step_ % steps_per_epoch;
    if (first == 0) epoch_loss_sum_ = epoch_examples_ = epoch_correct_ = epoch_weight_ = 0;
    if (options_.epochs > 1 && options_.progress) std::fprintf(stderr, "Epoch %lld/%d\n", (long long)epoch + 1, options_.epochs);
    const int64_t last = std::min(steps_per_epoch, total_steps - epoch * steps_per_epoch);
    std::unique_ptr<ProgressBar> bar;
    if (options_.progress) bar = std::make_unique<ProgressBar>(last, stderr, terminal);
    for (int64_t s = first; s < last; ++s) {
      auto t0 = std::chrono::steady_clock::now();
      zero_gradients();
      const int64_t b0 = s * k, b1 = std::min(batches, b0 + k);
      LossSums sums;
      double batch_loss_times_b = 0, examples = 0, tokens = 0;
      for (int64_t b = b0; b < b1; ++b) {
        Batch batch = data.batch(size_t(epoch), size_t(b));
        LossSums one;
        accumulate_gradients(batch, 1.0 / double(batch.batch_size * batch.seq_len * (b1 - b0)), one);
        batch_loss_times_b += one.weighted_ce / double(batch.seq_len);  // (Σw·CE/(B·T))·B
        examples += double(batch.batch_size);
        tokens += double(batch.batch_size * batch.seq_len);
        sums.weighted_correct += one.weighted_correct;
        sums.weight += one.weight;
        sums.weighted_ce += one.weighted_ce;
      }
      const double lr = options_.schedule.at(step_);
      optimizer_->step(params_, lr);
      ++step_;
      epoch_loss_sum_ += batch_loss_times_b;
      epoch_examples_ += examples;
      epoch_correct_ += sums.weighted_correct;
      epoch_weight_ += sums.weight;
      metrics = {epoch_loss_sum_ / epoch_examples_, epoch_weight_ > 0 ? epoch_correct_ / epoch_weight_ : 0};
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (bar) bar->update(s + 1, {{"loss", metrics.loss}, {"sparse_categorical_accuracy", metrics.accuracy}});
      if (log) {
        json line = {{"step", step_}, {"epoch", epoch + 1}, {"loss", batch_loss_times_b / examples},
                     {"epoch_loss", metrics.loss}, {"accuracy", metrics.accuracy}, {"learning_rate", lr},
                     {"tokens_per_s", tokens / seconds}, {"ms_per_step", seconds * 1e3}};
        std::fprintf(log, "%s\n", line.dump().c_str());
        std::fflush(log);
      }
      const bool stop = stop_requested && stop_requested->load();
      if (!options_.checkpoint_path.empty() &&
          (stop || (options_.checkpoint_every > 0 && step_ % options_.checkpoint_every == 0)))
        save_checkpoint(options_.checkpoint_path);
      if (options_.kill_after_step > 0 && step_ == options_.kill_after_step) std::raise(SIGKILL);
      if (stop) {
        interrupted_ = true;
        if (log) std::fclose(log);
        if (bar) std::fprintf(stderr, "\n");
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
  write_safetensors(path, tensors, meta);
}

void Trainer::load_checkpoint(const std::string& path) {
  std::map<std::string, HostTensor> tensors = read_safetensors(path);
  // The metadata lives in the header; re-read it from the file.
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  in.read(header.data(), std::streamsize(n));
  json meta = json::parse(header).value("__metadata__", json::object());
  check(meta.value("format", "") == "meshtune-checkpoint-1", path, ": not a meshtune checkpoint");
  check(meta.value("mode", "") == (lora_ ? "lora" : "full"), path, ": checkpoint is for ",
        meta.value("mode", "?"), " training, this run is ", lora_ ? "lora" : "full");
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
  step_ = std::stoll(meta.value("step", "0"));
  optimizer_->iterations = std::stoll(meta.value("iterations", "0"));
  epoch_loss_sum_ = std::stod(meta.value("epoch_loss_sum", "0"));
  epoch_examples_ = std::stod(meta.value("epoch_examples", "0"));
  epoch_correct_ = std::stod(meta.value("epoch_correct", "0"));
  epoch_weight_ = std::stod(meta.value("epoch_weight", "0"));
}

}  // namespace meshtune
