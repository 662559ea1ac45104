#include "api/causal_lm.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "backend/cpu_backend.h"
#include "backend/cuda_devices.h"
#include "backend/reference_backend.h"
#include "core/error.h"
#include "core/memory.h"
#include "distribution/communicator.h"
#include "distribution/nccl.h"
#include "model/variables.h"
#include "store/checkpoint.h"
#include "store/lora_files.h"
#include "store/save.h"

namespace meshtune::api {

std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

GemmaCausalLM::GemmaCausalLM(GemmaCausalLM&&) noexcept = default;
GemmaCausalLM& GemmaCausalLM::operator=(GemmaCausalLM&&) noexcept = default;
GemmaCausalLM::~GemmaCausalLM() = default;

std::ostream& GemmaCausalLM::notes() const {
  static std::ostream nowhere(nullptr);  // a stream without a buffer writes nothing
  if (!is_main_process()) return nowhere;
  return options_.notes ? *options_.notes : std::cerr;
}

bool GemmaCausalLM::is_main_process() const { return mesh_ ? mesh_->comm().rank() == 0 : world().rank() == 0; }

std::string GemmaCausalLM::distribution_summary() const { return mesh_ ? plan_.summary : std::string(); }

// The error for a model directory without the tokenizer file its format has.
static void check_tokenizer_file(const ModelDir& dir, bool present) {
  check(present, dir.path, ": no tokenizer (",
        dir.format == ModelFormat::Keras ? "assets/tokenizer/vocabulary.spm" : "tokenizer.model", ")");
}

const Tokenizer& GemmaCausalLM::tokenizer() const {
  check_tokenizer_file(dir_, tokenizer_ != nullptr);
  return *tokenizer_;
}

// ---- loading -----------------------------------------------------------------------------------

GemmaCausalLM GemmaCausalLM::from_preset(const std::string& preset, const PresetOptions& options) {
  check(std::find(kDtypePolicies.begin(), kDtypePolicies.end(), options.dtype_policy) != kDtypePolicies.end(),
        "dtype policy (--dtype-policy) must be float32, mixed_bfloat16 or bfloat16, got '", options.dtype_policy, "'");
  check(options.quantize.empty() || options.quantize == "int8", "quantize (--quantize) must be int8, got '",
        options.quantize, "'");
  check(options.backend == "cpu" || options.backend == "cuda" || options.backend == "reference" ||
            options.backend == "reference-device",
        "device (--device) must be cpu or cuda, got '", options.backend, "'");
  GemmaCausalLM lm;
  lm.options_ = options;
  if (options.backend == "cuda") {
    lm.backend_ = make_cuda_backend();
  } else if (options.backend == "reference") {
    lm.backend_ = std::make_unique<ReferenceBackend>();
  } else if (options.backend == "reference-device") {
    lm.backend_ = std::make_unique<ReferenceBackend>(Device::Cuda);
  } else {
    lm.backend_ = std::make_unique<CpuBackend>();
  }
  lm.dir_ = inspect_model_dir(resolve_model_path(preset, options.models_dir));
  lm.sequence_length_ = lm.dir_.sequence_length;
  if (lm.backend_->device() != Device::Host && options.distribution.wants_mesh()) {
    // A mesh of GPUs: collectives on device memory over NCCL, on the backend's stream.
    lm.device_comm_ = options.backend == "cuda" ? make_nccl_communicator(world(), cuda_stream_of(*lm.backend_))
                                                : make_device_tagged_communicator(world(), lm.backend_->device());
  }
  lm.mesh_ = options.distribution.make_mesh(lm.device_comm_ ? *lm.device_comm_ : world());
  LoadOptions load;
  if (lm.mesh_) {
    // The layout and the tensor-parallel plan first: a bad layout fails before the weights are read.
    const GemmaConfig config = read_model_config(lm.dir_);
    std::string warning;
    lm.distribution_.mesh = lm.mesh_.get();
    lm.distribution_.layout =
        options.distribution.make_layout(config, lm.mesh_->shape(), lm.mesh_->axis_names(), &warning);
    lm.distribution_.batch_axis = options.distribution.batch_axis;
    lm.distribution_.tensor_parallel = options.distribution.tensor_parallel;
    if (!warning.empty()) lm.notes() << "meshtune: warning: " << warning << "\n";
    lm.plan_ = plan_tensor_parallel(config, lm.distribution_.layout, *lm.mesh_, lm.distribution_.batch_axis,
                                    lm.distribution_.tensor_parallel);
    load = sharded_loading(lm.distribution_.layout, *lm.mesh_);  // each process reads only its blocks
  }
  const auto t0 = std::chrono::steady_clock::now();
  load.keep_bf16 = !options.fp32_weights;
  load.quantize_int8 = options.quantize == "int8";
  // Under a bf16 policy, matrices that are not trained are stored in bf16 once: the same values
  // Keras' per-call cast gives, at half the memory.
  const bool bf16_policy = options.dtype_policy != "float32";
  load.bf16_matrices = bf16_policy && !options.train_all_weights;
  lm.base_rounded_to_bf16_ = load.bf16_matrices;
  lm.model_ = load_model(lm.dir_, load);
  if (bf16_policy) lm.precision_ = MatmulPrecision::BF16;
  lm.config_ = lm.model_.config;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  lm.notes() << "loaded " << lm.dir_.path << " ("
             << (lm.dir_.format == ModelFormat::Keras ? "Keras preset" : "Hugging Face checkpoint") << ", Gemma "
             << lm.config_.family << ", " << lm.config_.num_parameters() << " parameters) in " << seconds << " s\n";
  if (!options.lora.empty()) {
    LoraWeights adapter = load_lora_adapter(options.lora, lm.config_);
    // Over int8 weights the adapter stays a low-rank term (Keras does not merge either: merging
    // would need a float copy of W and re-quantizing changes the numbers). Under a mesh it is
    // applied to each process' part when the compute model is made (inference_model).
    const bool low_rank = lm.model_.has_int8() || lm.mesh_;
    lm.notes() << (lm.mesh_ ? "will apply" : low_rank ? "attached" : "merged") << " LoRA adapter " << options.lora
               << " (rank " << adapter.rank << ", " << adapter.num_parameters() << " parameters)"
               << (lm.mesh_ ? " to each process' part\n" : "\n");
    if (low_rank) {
      lm.attached_ = std::make_unique<LoraWeights>(std::move(adapter));
      if (!lm.mesh_) attach_lora(lm.model_, *lm.attached_, lm.config_);
    } else {
      lm.model_ = merge_lora(lm.model_, adapter);
      if (load.bf16_matrices)  // the merged matrices are fp32: store them as bf16 too
        for (const VariableSpec& spec : gemma_variables(lm.config_))
          if (WeightMatrix* w = lm.model_.matrix(spec.slot, spec.layer)) *w = to_bf16_matrix(*w);
    }
  }
  for (const VariableSpec& spec : gemma_variables(lm.config_)) {
    const WeightMatrix* w = lm.model_.matrix(spec.slot, spec.layer);
    lm.stored_dtypes_.push_back(w ? w->dtype : DType::F32);
  }
  if (options.need_tokenizer) {
    check_tokenizer_file(lm.dir_, !lm.dir_.tokenizer_path.empty());
    lm.tokenizer_ = std::make_unique<Tokenizer>(lm.dir_.tokenizer_path);
    check(lm.tokenizer_->vocab_size() <= lm.config_.vocab_size, lm.dir_.tokenizer_path, ": the tokenizer has ",
          lm.tokenizer_->vocab_size(), " pieces but ", lm.dir_.config_path, " says vocabulary_size ",
          lm.config_.vocab_size, ": its ids would not fit the embedding");
  }
  return lm;
}

void GemmaCausalLM::set_sequence_length(int length) {
  check(length >= 1 && length <= config_.max_sequence_length, "sequence_length (--seq-len) must be in [1, ",
        config_.max_sequence_length, "] (the model's maximum sequence length), got ", length);
  sequence_length_ = length;
}

// ---- variables ---------------------------------------------------------------------------------

const LoraWeights* GemmaCausalLM::lora() const {
  if (trainer_) return trainer_->lora() ? &*trainer_->lora() : nullptr;
  return lora_ ? &*lora_ : nullptr;
}

std::vector<VariableInfo> GemmaCausalLM::variables() const {
  if (!mesh_) return variables_on(DistributionOptions{}, /*with_sharding=*/false);
  std::vector<VariableInfo> rows = variables_on(DistributionOptions{}, false);
  for (VariableInfo& v : rows) v.sharding = distribution_.layout.resolve(v.path, v.shape, *mesh_);
  return rows;
}

std::vector<VariableInfo> GemmaCausalLM::variables_on(const DistributionOptions& dry_run, bool with_sharding) const {
  // Every variable as Keras lists it: an int8 layer's kernel is int8 and frozen, and its float32
  // scale (kernel_scale, embeddings_scale) is a variable of its own, frozen too. The dtypes are the
  // stored ones (the base before any fit: the trainer keeps the base as loaded).
  std::vector<VariableInfo> rows;
  const LoraWeights* adapters = lora();
  const std::vector<VariableSpec> specs = gemma_variables(config_);
  for (size_t i = 0; i < specs.size(); ++i) {
    const VariableSpec& v = specs[i];
    const DType dtype = stored_dtypes_[i];
    rows.push_back({v.keras_path, v.keras_shape, dtype, dtype != DType::I8 && !adapters, {}});
    if (dtype == DType::I8)
      rows.push_back({keras_layer(v) + (v.slot == Slot::Embeddings ? "/embeddings_scale" : "/kernel_scale"),
                      keras_int8_scale_shape(v), DType::F32, false, {}});
  }
  if (adapters)
    for (const LoraAdapter& a : adapters->adapters) {
      rows.push_back({a.keras_path(config_) + "/lora_kernel_a", a.a_shape, DType::F32, true, {}});
      rows.push_back({a.keras_path(config_) + "/lora_kernel_b", a.b_shape, DType::F32, true, {}});
    }
  if (with_sharding) {
    const std::vector<int> shape = dry_run.shape(1);
    const std::vector<std::string> names = dry_run.names(shape);
    const LayoutMap layout = dry_run.make_layout(config_, shape, names);
    for (VariableInfo& v : rows) v.sharding = layout.resolve(v.path, v.shape, shape, names);
  }
  return rows;
}

ParameterSummary GemmaCausalLM::summary() const {
  ParameterSummary s;
  for (const VariableInfo& v : variables_on(DistributionOptions{}, false)) {
    (v.trainable ? s.trainable : s.non_trainable) += num_elements(v.shape);
    (v.trainable ? s.trainable_bytes : s.non_trainable_bytes) += v.bytes();
  }
  s.total = s.trainable + s.non_trainable;
  s.total_bytes = s.trainable_bytes + s.non_trainable_bytes;
  return s;
}

// ---- LoRA --------------------------------------------------------------------------------------

void GemmaCausalLM::check_before_fit(const char* what) const {
  check(!trainer_, what, ": call it before the first fit (it changes what is trained)");
  check(!(mesh_ && attached_), what, ": the adapter given at load (", options_.lora,
        ") is for inference under a mesh; continue training from it with load_lora_weights (--lora-init)");
}

void GemmaCausalLM::enable_lora(const LoraOptions& options) {
  check_before_fit("enable_lora");
  check(options.rank >= 1, "LoRA rank (--lora-rank) must be at least 1, got ", options.rank);
  check(std::isfinite(options.alpha) && options.alpha >= 0, "LoRA alpha (--lora-alpha) must be finite and ≥ 0, got ",
        options.alpha);
  lora_ = meshtune::enable_lora(config_, options.rank, parse_lora_targets(options.targets), options.seed, options.alpha);
}

void GemmaCausalLM::load_lora_weights(const std::string& path) {
  check_before_fit("load_lora_weights");
  lora_ = load_lora_adapter(path, config_);
}

bool GemmaCausalLM::keras_lora_layout() const {
  const LoraWeights* l = lora();
  return l && std::all_of(l->adapters.begin(), l->adapters.end(),
                          [](const LoraAdapter& a) { return a.style == LoraStyle::Keras; });
}

void GemmaCausalLM::save_lora_weights(const std::string& path) const {
  check(lora() != nullptr, "save_lora_weights: LoRA is not enabled (enable_lora first)");
  check(keras_lora_layout(), path, ": a PEFT-style adapter has a B matrix per head, which Keras' save_lora_weights "
        "layout cannot hold (write it as a PEFT directory)");
  if (is_main_process()) save_keras_lora(path, config_, *lora());
}

void GemmaCausalLM::save_peft_adapter(const std::string& dir) const {
  check(lora() != nullptr, "save_peft_adapter: LoRA is not enabled (enable_lora first)");
  namespace fs = std::filesystem;
  if (is_main_process())
    meshtune::save_peft_adapter(dir, config_, *lora(), fs::absolute(dir_.path).lexically_normal().string());
}

// ---- inference ---------------------------------------------------------------------------------

Context GemmaCausalLM::context() const {
  if (trainer_) return trainer_->context();
  return Context{*backend_, precision_,
                 TensorParallelGroup(mesh_ && plan_.active() ? &mesh_->axis_comm(plan_.axis) : nullptr)};
}

GemmaModel GemmaCausalLM::inference_model() const {
  if (trainer_) return trainer_->inference_model();
  // The adapter in use before any fit: one enabled or loaded for training, else one given at load.
  LoraWeights* adapter = lora_ ? &const_cast<LoraWeights&>(*lora_) : mesh_ ? attached_.get() : nullptr;
  if (mesh_) {
    // This process' part: its blocks as the plan computes with them (shallow copies of the
    // weights: the blocks are shared with model_, which fit() hands to the trainer).
    if (!sharded_) sharded_ = std::make_unique<ShardedModel>(model_, distribution_.layout, *mesh_, plan_);
    GemmaModel m = sharded_->compute_model(/*by_layer=*/false);
    if (!adapter) return on_backend(m);
    if (m.has_int8()) {
      attach_lora(m, *adapter, config_, plan_);
      return m;
    }
    return on_backend(merge_lora_parts(m, *adapter, config_, plan_));
  }
  if (!adapter) return on_backend(model_);
  GemmaModel m = model_;
  if (m.has_int8()) attach_lora(m, *adapter, config_);
  else m = merge_lora(m, *adapter);
  return on_backend(m);
}

// Every matrix' storage (the embedding is one of them): what identifies a host model's weights.
static std::vector<const void*> matrix_storage(const GemmaModel& m) {
  std::vector<const void*> storage;
  for (const auto& spec : gemma_variables(m.config))
    if (const WeightMatrix* w = m.matrix(spec.slot, spec.layer)) storage.push_back(w->data);
  return storage;
}

GemmaModel GemmaCausalLM::on_backend(const GemmaModel& host) const {
  if (backend_->device() == Device::Host) return host;
  if (!uploaded_ || matrix_storage(host) != matrix_storage(uploaded_source_)) {
    uploaded_.reset();  // the old copy's device memory first
    uploaded_ = upload_model(host, *backend_);
    // Kept (sharing its storage) so that its addresses cannot be reused by a later model — a merge
    // with other adapter values — that would then look like this one.
    uploaded_source_ = host;
  }
  return *uploaded_;
}

GemmaModel GemmaCausalLM::current_model() const {
  if (trainer_ && backend_->device() != Device::Host && !mesh_ && trainer_->lora()) {
    // The trainer's weights are device memory; the host keeps the base it was given.
    return merge_lora(model_, *trainer_->lora());
  }
  if (trainer_) return trainer_->current_model();
  GemmaModel m = mesh_ ? ShardedModel(model_, distribution_.layout, *mesh_, plan_).materialize() : model_;
  if (attached_) {  // low-rank terms over int8 weights: writing the model merges (and re-quantizes)
    m.low_rank.clear();
    m = merge_lora(m, *attached_);
  }
  if (lora_) m = merge_lora(m, *lora_);
  return m;
}

GenerateOptions GemmaCausalLM::default_generate_options() const {
  GenerateOptions options;
  options.max_length = sequence_length_;
  options.stop_token_ids = tokenizer_ ? default_stop_token_ids(model_, *tokenizer_) : std::vector<int>{1};
  return options;
}

namespace {
// Floats per token of one block's fp32 working buffers in a forward pass (model/gemma.h
// BlockActivations and BlockScratch): what generate's prefill and each training block compute in.
double block_working_floats(const GemmaConfig& c) {
  const double D = c.hidden_dim, F = c.ffw_dim, NH = double(c.num_query_heads) * c.head_dim,
               KH = double(c.num_key_value_heads) * c.head_dim;
  return 6 * D + 3 * NH + 3 * KH + 2 * F;
}
}  // namespace

std::vector<GeneratedText> GemmaCausalLM::generate(const std::vector<std::string>& prompts,
                                                   GenerateOptions options) const {
  check(options.max_length >= 1, "max_length (--max-length) must be at least 1, got ", options.max_length);
  // All prompts run at once: their KV cache and the prefill's working buffers must fit.
  const GemmaConfig c = plan_.active() ? plan_.local_config(config_) : config_;
  const double rows = double(prompts.size()) * double(options.max_length);
  const double KH = double(c.num_key_value_heads) * c.head_dim;
  const double need = rows * (double(c.num_layers) * 2 * KH + block_working_floats(c)) * 4 +
                      double(prompts.size()) * double(c.vocab_size) * 4;
  const MemoryLimit limit = memory_limit();
  // (A max_length beyond the model's maximum is generate_text's error, checked first.)
  check(need <= limit.bytes || options.max_length > config_.max_sequence_length, "generate: ", prompts.size(), " prompts × max_length ", options.max_length,
        " (--max-length) need about ", format_bytes(need), " for the KV cache and working buffers, but ", limit.source,
        " allows ", format_bytes(limit.bytes), "; generate fewer prompts at a time or a shorter max_length");
  return generate_text(context(), inference_model(), tokenizer(), prompts, options);
}

void GemmaCausalLM::logits(const std::vector<int32_t>& ids, const std::vector<int32_t>& mask, int64_t B, int64_t T,
                           std::vector<float>* hidden, float* logits) const {
  check(B > 0 && T > 0 && int64_t(ids.size()) == B * T, "logits: ", ids.size(), " token ids for a [", B, ", ", T,
        "] batch");
  check(mask.empty() || mask.size() == ids.size(), "logits: the padding mask has ", mask.size(), " values, the ids ",
        ids.size());
  const GemmaModel m = inference_model();
  const Context ctx = context();
  Backend& b = ctx.backend;
  KVCache cache(m.config, B, T, b, /*keep_keys=*/false);  // one pass: nothing continues it
  if (!mask.empty()) {  // else every position is a real token
    std::vector<uint8_t> key_valid(mask.size());
    for (size_t i = 0; i < mask.size(); ++i) key_valid[i] = mask[i] != 0;
    cache.set_key_valid(b, key_valid);
  }
  const FloatBuffer h = backbone_forward(ctx, m, ids.data(), B, T, 0, cache);
  if (logits) {  // into the caller's host buffer: directly where the backend computes in host memory
    const Floats host(logits, size_t(B * T * m.config.vocab_size));
    if (b.device() == Device::Host) {
      lm_head(ctx, m, h, B * T, host);
    } else {
      FloatBuffer out;
      b.resize(out, host.size);
      lm_head(ctx, m, h, B * T, out);
      b.download(out, host);
    }
  }
  if (hidden) {
    hidden->resize(h.size());
    b.download(h, *hidden);
  }
}

// ---- training ----------------------------------------------------------------------------------

void GemmaCausalLM::compile(const CompileOptions& o) {
  check(!trainer_, "compile: the model was already trained (compile before the first fit)");
  auto finite_at_least = [](double v, double low, const char* name) {
    check(std::isfinite(v) && v >= low, name, " must be finite and ≥ ", low, ", got ", v);
  };
  finite_at_least(o.learning_rate, 0, "learning rate (--lr)");
  finite_at_least(o.weight_decay, 0, "weight decay (--weight-decay)");
  check(std::isfinite(o.beta_1) && o.beta_1 >= 0 && o.beta_1 < 1, "beta_1 (--beta1) must be in [0, 1), got ", o.beta_1);
  check(std::isfinite(o.beta_2) && o.beta_2 >= 0 && o.beta_2 < 1, "beta_2 (--beta2) must be in [0, 1), got ", o.beta_2);
  check(std::isfinite(o.epsilon) && o.epsilon > 0, "epsilon (--epsilon) must be finite and > 0, got ", o.epsilon);
  finite_at_least(o.clipnorm, 0, "clipnorm (--clipnorm)");
  finite_at_least(o.clipvalue, 0, "clipvalue (--clipvalue)");
  finite_at_least(o.global_clipnorm, 0, "global_clipnorm (--global-clipnorm)");
  finite_at_least(double(o.warmup_steps), 0, "warmup steps (--warmup-steps)");
  check(std::isfinite(o.final_lr_fraction) && o.final_lr_fraction >= 0 && o.final_lr_fraction <= 1,
        "final learning-rate fraction (--final-lr-fraction) must be in [0, 1], got ", o.final_lr_fraction);
  check(o.schedule == "constant" || o.schedule == "linear" || o.schedule == "cosine",
        "schedule (--schedule) must be constant, linear or cosine, got '", o.schedule, "'");
  compiled_ = o;
}

BatchStream GemmaCausalLM::batches(const Dataset& data, const FitRunOptions& run, bool shuffle) const {
  BatchOptions b;
  b.sequence_length = run.sequence_length > 0 ? run.sequence_length : sequence_length_;
  b.batch_size = run.batch_size;
  b.take = run.take;
  b.shuffle = shuffle;
  b.shuffle_seed = run.shuffle_seed;
  b.train_on_all_turns = run.train_on_all_turns;
  check(b.sequence_length <= config_.max_sequence_length, "sequence_length (--seq-len) ", b.sequence_length,
        " exceeds the model's maximum sequence length ", config_.max_sequence_length);
  return BatchStream(data, data.pretokenized() ? nullptr : &tokenizer(), b);
}

namespace {
// Keras' History: each epoch's running means as its last step left them.
class HistoryRecorder : public TrainingLog {
 public:
  explicit HistoryRecorder(History& h) : h_(h) {}
  void step_end(const StepReport& r) override {
    if (r.epoch != epoch_) {
      epoch_ = r.epoch;
      h_.loss.push_back(0);
      h_.accuracy.push_back(0);
    }
    h_.loss.back() = r.epoch_loss;
    h_.accuracy.back() = r.accuracy;
  }

 private:
  History& h_;
  int64_t epoch_ = -1;
};

// Turns an outside stop request (a signal handler's flag) into the model's stop_training().
class StopRelay : public TrainingLog {
 public:
  StopRelay(const std::atomic<bool>* outside, std::atomic<bool>& stop) : outside_(outside), stop_(stop) {}
  void step_end(const StepReport&) override {
    if (outside_ && outside_->load()) stop_.store(true);
  }

 private:
  const std::atomic<bool>* outside_;
  std::atomic<bool>& stop_;
};

// Bytes currently allocated through malloc (glibc's mallinfo2: small blocks plus mmap'd ones).
size_t allocated_bytes() {
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
}
}  // namespace

History GemmaCausalLM::fit(const Dataset& data, const FitRunOptions& run, const std::vector<Callback*>& callbacks) {
  check(compiled_.has_value(), "fit: call compile (the optimizer) first");
  check(run.batch_size >= 1, "batch size (--batch-size) must be at least 1, got ", run.batch_size);
  check(run.sequence_length >= 0, "sequence length (--seq-len) must be at least 1, got ", run.sequence_length);
  check(run.epochs >= 0, "epochs (--epochs) must not be negative, got ", run.epochs);
  check(run.steps >= 0, "steps (--steps) must not be negative, got ", run.steps);
  check(run.epochs > 0 || run.steps > 0, "fit: give epochs or steps");
  check(run.grad_accumulation >= 1, "gradient accumulation (--grad-accum) must be at least 1, got ",
        run.grad_accumulation);
  check(run.checkpoint_every >= 0, "checkpoint interval (--checkpoint-every) must not be negative, got ",
        run.checkpoint_every);
  const BatchStream stream = batches(data, run, run.shuffle);
  // Answers cut off by the sequence length: refused when no example is left to learn from.
  const int length = run.sequence_length > 0 ? run.sequence_length : sequence_length_;
  const size_t without_targets = stream.examples_without_targets();
  check(without_targets < stream.num_examples(), data.source, ": no example keeps a token to train on: at sequence_length (--seq-len) ",
        length, " every prompt fills all ", length, " positions, so every answer is cut off; raise the sequence length");
  if (without_targets > 0)
    notes() << "warning: " << without_targets << " of " << stream.num_examples()
            << " examples keep no token to train on at sequence_length (--seq-len) " << length
            << " (the prompt fills every position): they add nothing to the loss\n";
  const int64_t steps_per_epoch =
      (int64_t(stream.steps_per_epoch()) + run.grad_accumulation - 1) / run.grad_accumulation;
  const int64_t run_steps = run.epochs == 0 ? run.steps
                            : run.steps > 0 ? std::min<int64_t>(run.steps, steps_per_epoch * run.epochs)
                                            : steps_per_epoch * run.epochs;
  const bool first_fit = !trainer_;
  if (first_fit) {
    // A run the machine cannot hold fails now, with the flags that size it.
    const MemoryEstimate need = training_memory(run.batch_size, length);
    const MemoryLimit limit = memory_limit();
    check(need.total() - need.mapped_weights <= limit.bytes, "fit: batch ", run.batch_size, " × sequence_length ", length,
          " (--batch-size, --seq-len) needs about ", need.summary(), " in this process, but ", limit.source,
          " allows ", format_bytes(limit.bytes), "; lower --batch-size or --seq-len (--grad-accum keeps the effective batch), "
          "or use mixed_bfloat16 or a mesh");
    check(lora_ || !model_.has_int8(), dir_.path,
          ": int8 weights are frozen (as in Keras): train them with LoRA (enable_lora, --lora-rank), not all weights (--full)");
    check(lora_ || !base_rounded_to_bf16_, "training every weight under ", options_.dtype_policy,
          " needs the weights kept as stored at load (PresetOptions::train_all_weights; finetune --full sets it)");
    check_before_fit("fit");
    check(!(run.resume && run.checkpoint_path.empty()), "fit: resume needs a checkpoint path");
    FitOptions fit;
    fit.adamw.learning_rate = compiled_->learning_rate;
    fit.adamw.weight_decay = compiled_->weight_decay;
    fit.adamw.beta_1 = compiled_->beta_1;
    fit.adamw.beta_2 = compiled_->beta_2;
    fit.adamw.epsilon = compiled_->epsilon;
    fit.adamw.exclude_from_weight_decay = compiled_->exclude_from_weight_decay;
    fit.adamw.clipnorm = compiled_->clipnorm;
    fit.adamw.clipvalue = compiled_->clipvalue;
    fit.adamw.global_clipnorm = compiled_->global_clipnorm;
    sharded_.reset();  // generate's view of the weights: the trainer makes its own
    const size_t one_device_bytes = size_t(config_.num_parameters()) * (model_.embeddings.dtype == DType::BF16 ? 2 : 4);
    if (backend_->device() != Device::Host) {
      // The trainer computes with the weights in the device's memory; the host copy stays the base
      // that export merges the trained adapter into (current_model).
      // Under a mesh the trainer cuts the host weights into blocks and uploads what it computes with.
      trainer_ = std::make_unique<Trainer>(*backend_, precision_, mesh_ ? model_ : on_backend(model_), lora_, fit,
                                           distribution_);
      uploaded_.reset();
      uploaded_source_ = GemmaModel{};
    } else {
      trainer_ = std::make_unique<Trainer>(*backend_, precision_, std::move(model_), lora_, fit, distribution_);
      model_ = GemmaModel{};
      model_.config = config_;
    }
    lora_.reset();  // the trainer's copy is the one that trains
    if (mesh_) notes() << "meshtune: " << trainer_->plan_summary() << "\n";
    // What sharding saves, from our tables and from the allocator.
    notes() << (mesh_ ? "mesh " + mesh_->describe() : std::string("one device")) << ": this process holds "
            << trainer_->held_weight_bytes() << " bytes of weights (one device: " << one_device_bytes
            << "); allocator: " << allocated_bytes() << " bytes in use\n";
    if (run.resume) {
      check(std::filesystem::exists(run.checkpoint_path), "resume (--resume): no checkpoint at ", run.checkpoint_path);
      trainer_->load_checkpoint(run.checkpoint_path);
      notes() << "resumed from " << run.checkpoint_path << " at step " << trainer_->step() << "\n";
    }
  } else {
    check(!run.resume, "fit: resume is only for the first fit of a model");
  }
  const LoraWeights* adapters = lora();
  notes() << (adapters ? "LoRA rank " + std::to_string(adapters->rank) : std::string("full fine-tuning"))
          << ": trainable params " << trainer_->trainable_count() << ", non-trainable "
          << (adapters ? config_.num_parameters() : 0) << "; " << stream.num_examples() << " examples, "
          << steps_per_epoch << " steps per epoch\n";

  // The first fit (and a resumed one) runs to its own end; a later fit trains `run_steps` more.
  FitOptions fit = trainer_->options();
  const int64_t first = trainer_->step();
  fit.epochs = first_fit ? run.epochs : 0;
  fit.max_steps = first_fit ? run.steps : first + run_steps;
  fit.grad_accumulation = run.grad_accumulation;
  fit.checkpoint_path = run.checkpoint_path;
  fit.checkpoint_every = run.checkpoint_every;
  fit.schedule.kind = compiled_->schedule;
  fit.schedule.base = compiled_->learning_rate;
  fit.schedule.warmup_steps = compiled_->warmup_steps;
  fit.schedule.total_steps = first_fit ? run_steps : first + run_steps;
  fit.schedule.final_fraction = compiled_->final_lr_fraction;
  trainer_->set_options(fit);

  History history;
  HistoryRecorder recorder(history);
  StopRelay relay(run.stop_signal, *stop_);
  std::vector<TrainingLog*> logs(callbacks.begin(), callbacks.end());
  logs.push_back(&recorder);
  logs.push_back(&relay);
  stop_->store(false);
  const auto start = std::chrono::steady_clock::now();
  const EpochMetrics last = trainer_->fit(stream, logs, stop_.get());
  if (history.loss.empty()) {  // no step ran (a resumed run that had finished): the metrics it had
    history.loss.push_back(last.loss);
    history.accuracy.push_back(last.accuracy);
  }
  history.train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  history.steps = trainer_->step();
  history.interrupted = trainer_->interrupted();
  history.trainable_params = trainer_->trainable_count();
  return history;
}

EpochMetrics GemmaCausalLM::evaluate(const Dataset& data, const FitRunOptions& run) const {
  check(run.batch_size >= 1, "batch size (--batch-size) must be at least 1, got ", run.batch_size);
  const BatchStream stream = batches(data, run, /*shuffle=*/false);
  if (trainer_) return trainer_->evaluate(stream);
  return evaluate_model(context(), inference_model(), stream);
}

long long GemmaCausalLM::trainable_count() const {
  if (trainer_) return trainer_->trainable_count();
  return summary().trainable;
}

std::string MemoryEstimate::summary() const {
  return format_bytes(total()) + ": weights " + format_bytes(weights) + ", trainable state " + format_bytes(trainable_state) +
         ", activations " + format_bytes(activations) + ", loss chunk " + format_bytes(loss_chunk);
}

MemoryEstimate GemmaCausalLM::training_memory(int batch_size, int sequence_length) const {
  const int64_t T = sequence_length > 0 ? sequence_length : sequence_length_;
  // This process' part: its rows of the batch and, under tensor parallelism, its heads and columns.
  int64_t B = std::max(1, batch_size);
  if (mesh_) {
    const int axis = mesh_->axis_index(distribution_.batch_axis);
    if (axis >= 0) B = (B + mesh_->axis_size(axis) - 1) / mesh_->axis_size(axis);
  }
  const GemmaConfig c = plan_.active() ? plan_.local_config(config_) : config_;
  const double D = c.hidden_dim, F = c.ffw_dim, NH = double(c.num_query_heads) * c.head_dim,
               KH = double(c.num_key_value_heads) * c.head_dim, M = double(B) * double(T);
  const bool bf16 = options_.dtype_policy != "float32";
  MemoryEstimate e;
  e.weights = double(held_weight_bytes());
  if (!trainer_ && !sharded_)
    for (const VariableSpec& spec : gemma_variables(config_))
      if (const WeightMatrix* w = model_.matrix(spec.slot, spec.layer); w && w->mapped) e.mapped_weights += double(w->nbytes());
  const bool full = !lora_ && !trainer_;
  if (full) {  // fp32 working copies (where the weights are stored narrower), gradients, two moments
    const double params = double(c.num_parameters());
    e.trainable_state = params * 4 * 3 + std::max(0.0, params * 4 - e.weights);
  } else {
    e.trainable_state = double(trainable_count()) * 4 * 4;  // A and B: values, gradients, two moments
  }
  // Kept for backward per layer (model/gemma.h BlockActivations), in the policy's compute dtype.
  const double saved = 6 * D + 2 * NH + 2 * KH + 2 * F + (c.use_query_key_norm ? NH + KH : 0);
  // Working fp32 buffers of one block (its activations and their gradients), the scratch and the
  // residual stream (training keeps no KV cache: each block's attention reads its own keys and values).
  const double working = 2 * block_working_floats(c) + F + 6 * D;
  e.activations = M * (double(c.num_layers) * saved * (bf16 ? 2 : 4) + working * 4);
  e.loss_chunk = double(loss_chunk_rows(c.vocab_size)) * (double(c.vocab_size) + 2 * D) * 4;
  return e;
}

size_t GemmaCausalLM::held_weight_bytes() const {
  return trainer_ ? trainer_->held_weight_bytes() : sharded_ ? sharded_->held_bytes() : model_.weight_bytes();
}

// ---- saving ------------------------------------------------------------------------------------

void GemmaCausalLM::save_to_preset(const std::string& dir) const { export_model("keras", dir); }

void GemmaCausalLM::export_model(const std::string& format, const std::string& dir) const {
  check(format == "keras" || format == "hf", "export format (--to) must be keras or hf, got '", format, "'");
  const GemmaModel m = current_model();  // every process takes part in the gathers
  if (!is_main_process()) return;
  if (format == "keras") save_keras_preset(m, dir_.tokenizer_path, sequence_length_, dir);
  else save_hf_checkpoint(m, dir_.tokenizer_path, dir);
}

int64_t GemmaCausalLM::apply_checkpoint(const std::string& path) {
  check(!trainer_ && !mesh_, "apply_checkpoint: only on a freshly loaded model without a mesh");
  check(!lora_ && options_.lora.empty(), "a checkpoint and a LoRA adapter (--lora) cannot be combined");
  TrainedParameters trained = read_trained_parameters(path);
  auto take = [&](const std::string& name, size_t size) {
    auto it = trained.values.find(name);
    check(it != trained.values.end(), path, ": no ", name, " (a checkpoint of another model?)");
    check(it->second.size() == size, path, ": ", name, " has ", it->second.size(), " values, ", dir_.config_path,
          " implies ", size);
    std::vector<float> values = std::move(it->second);
    trained.values.erase(it);
    return values;
  };
  if (trained.mode == "full") {
    for (const VariableSpec& spec : gemma_variables(config_))
      set_variable(model_, spec, take(spec.keras_path, size_t(num_elements(spec.hf_shape))));
  } else {
    // The adapters' targets, from the checkpoint's paths ".../<target>/lora_kernel_a".
    std::vector<std::string> targets;
    for (const auto& [name, values] : trained.values) {
      const size_t end = name.rfind("/lora_kernel_a");
      if (end == std::string::npos) continue;
      const size_t begin = name.rfind('/', end - 1) + 1;
      const std::string target = name.substr(begin, end - begin);
      if (std::find(targets.begin(), targets.end(), target) == targets.end()) targets.push_back(target);
    }
    LoraWeights adapter =
        meshtune::enable_lora(config_, trained.lora_rank, parse_lora_targets(targets), 0, trained.lora_alpha);
    for (LoraAdapter& ad : adapter.adapters) {
      ad.a = take(ad.keras_path(config_) + "/lora_kernel_a", ad.a.size());
      ad.b = take(ad.keras_path(config_) + "/lora_kernel_b", ad.b.size());
    }
    model_ = merge_lora(model_, adapter);
  }
  check(trained.values.empty(), path, ": ", trained.values.size(), " weights do not belong to ", dir_.path,
        " (first: ", trained.values.empty() ? "" : trained.values.begin()->first, ")");
  notes() << "applied " << trained.mode << " weights of step " << trained.step << " from " << path << "\n";
  return trained.step;
}

}  // namespace meshtune::api
