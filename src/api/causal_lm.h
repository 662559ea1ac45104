// The library: a Gemma causal LM with KerasHub's verbs — from_preset, summary and the variables
// with their shardings, enable_lora, generate, compile + fit (with callbacks), evaluate,
// save_lora_weights / load_lora_weights, save_to_preset, export — over the layers below
// (store, model, train, generate). The command line (src/cli) is flag parsing over this class, and
// the Python package binds it. No global state; every error is an Error (core/error.h) carrying
// one line that names the file, field or option and the rule. Nothing here prints to stdout; the
// one-line notes of loading and training go to the `notes` stream of PresetOptions (stderr by
// default, rank 0 only under a mesh).
//
// examples/tutorial.cpp is the tutorial written against it: from_preset → variables → generate →
// enable_lora → compile → fit (with Keras' progress bar as a callback) → generate.
#pragma once
#include <atomic>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "api/distribution.h"
#include "data/batches.h"
#include "data/dataset.h"
#include "generate/generate.h"
#include "model/lora.h"
#include "model/sharded_model.h"
#include "store/load.h"
#include "text/tokenizer.h"
#include "train/trainer.h"

namespace meshtune::api {

// Keras' dtype policy names.
inline const std::vector<std::string> kDtypePolicies = {"float32", "mixed_bfloat16", "bfloat16"};

struct PresetOptions {
  std::string models_dir;             // extra search root for preset names (then $MESHTUNE_MODELS)
  std::string dtype_policy = "float32";  // float32 | mixed_bfloat16 | bfloat16 (bf16 matmul inputs, fp32 sums)
  std::string quantize;               // "int8": Keras' quantize("int8") as the matrices load; "" = as stored
  bool fp32_weights = false;          // widen bf16-stored weights at load
  std::string lora;                   // an adapter (.lora.h5 or PEFT directory) applied at load: merged,
                                      // or kept as low-rank terms over int8 weights (as Keras)
  bool train_all_weights = false;     // fit() will train every weight (no enable_lora): under a bf16
                                      // policy the matrices stay as stored instead of being rounded to bf16
  bool need_tokenizer = true;         // false: load without one (token-id data, logits)
  DistributionOptions distribution;   // a mesh and layout (keras.distribution); empty = one process
  std::ostream* notes = nullptr;      // where one-line notes go (nullptr: std::cerr); rank 0 only
  std::string backend = "cpu";        // cpu | cuda (--device: an NVIDIA GPU, one per process) |
                                      // reference (the plain-loop oracle: slow, for checking) |
                                      // reference-device (the same loops on memory tagged as a GPU's:
                                      // tests run every device path of the API without a GPU)
};

struct LoraOptions {
  int rank = 4;
  std::vector<std::string> targets = {"query", "value"};  // or "all", or any of the seven matrices
  double alpha = 0;       // 0: alpha = rank (scale 1, as Keras)
  uint64_t seed = 0;      // seed of A's initialisation
};

// One row of the variable table (backbone.weights): Keras' path, shape and dtype, whether it is
// trainable, and — under a distribution — its PartitionSpec.
struct VariableInfo {
  std::string path;
  Shape shape;
  DType dtype = DType::F32;
  bool trainable = true;
  PartitionSpec sharding;  // empty when there is no distribution
  double bytes() const { return double(num_elements(shape)) * double(dtype_size(dtype)); }
};

// Keras' summary() totals.
struct ParameterSummary {
  long long total = 0, trainable = 0, non_trainable = 0;
  double total_bytes = 0, trainable_bytes = 0, non_trainable_bytes = 0;
};

// keras compile(optimizer=AdamW(...), loss=SparseCategoricalCrossentropy(from_logits=True),
// weighted_metrics=[SparseCategoricalAccuracy()]): the optimizer's settings and the schedule.
struct CompileOptions {
  double learning_rate = 5e-5, weight_decay = 0.01, beta_1 = 0.9, beta_2 = 0.999, epsilon = 1e-7;
  std::vector<std::string> exclude_from_weight_decay;  // variable names (regex search), e.g. bias, scale
  double clipnorm = 0, clipvalue = 0, global_clipnorm = 0;
  std::string schedule = "constant";  // constant | linear | cosine (decay to final_lr_fraction × lr)
  int64_t warmup_steps = 0;
  double final_lr_fraction = 0;
};

// fit(data, ...): how the data becomes batches and how long to train.
struct FitRunOptions {
  int epochs = 1;           // 0: as many as `steps` needs (the data is cycled)
  int64_t steps = 0;        // optimizer steps (0 = epochs); with both, whichever ends first
  int batch_size = 2;
  int sequence_length = 0;    // 0: the model's sequence_length() (the preprocessor's)
  int grad_accumulation = 1;
  size_t take = 0;            // only the first N examples (0 = all)
  bool shuffle = true;
  uint64_t shuffle_seed = 0;
  bool train_on_all_turns = false;  // conversations: the loss on every token instead of the model turns
  std::string checkpoint_path;      // "" = no checkpoints
  int64_t checkpoint_every = 0;     // steps; 0 = only at the end (and when stopped)
  bool resume = false;              // continue from checkpoint_path
  const std::atomic<bool>* stop_signal = nullptr;  // set (e.g. by SIGINT) to stop after the current step
};

// What fit() returns: per-epoch means as Keras' History holds them.
struct History {
  std::vector<double> loss, accuracy;  // "loss", "sparse_categorical_accuracy" per epoch (the last may be partial)
  int64_t steps = 0;                   // optimizer steps done in all (counting earlier fits and a resumed run)
  bool interrupted = false;            // stopped early (stop_training() or the stop signal)
  double train_seconds = 0;
  long long trainable_params = 0;
};

// What training needs in this process at a batch shape, estimated before it starts from the shapes
// and the dtype policy: the weights held, the trainable state (values, gradients, AdamW's two
// moments), the activations kept for backward with the step's working buffers, and the loss's
// logits chunk. A lower bound of the peak (allocator and library overheads come on top).
struct MemoryEstimate {
  double weights = 0, trainable_state = 0, activations = 0, loss_chunk = 0;
  double mapped_weights = 0;  // of `weights`, read through a file map: the page cache holds them, they need not fit
  double total() const { return weights + trainable_state + activations + loss_chunk; }
  std::string summary() const;  // "1.20 GiB: weights …, trainable state …, activations …, loss chunk …"
};

// Callbacks: any TrainingLog (train/training_log.h) — run_begin, epoch_begin, step_end (Keras'
// on_train_batch_end with its logs), checkpoint_saved, run_end. A callback stops the run between
// steps with GemmaCausalLM::stop_training().
using Callback = TrainingLog;

class GemmaCausalLM {
 public:
  // A model directory (Keras preset or Hugging Face checkpoint) or a preset name looked up in
  // options.models_dir and $MESHTUNE_MODELS. Under a distribution each process reads only its
  // blocks of the variables the layout splits.
  static GemmaCausalLM from_preset(const std::string& preset, const PresetOptions& options = {});
  GemmaCausalLM(GemmaCausalLM&&) noexcept;
  GemmaCausalLM& operator=(GemmaCausalLM&&) noexcept;
  ~GemmaCausalLM();

  const GemmaConfig& config() const { return config_; }
  const ModelDir& directory() const { return dir_; }
  const PresetOptions& options() const { return options_; }
  // The preprocessor's sequence_length (the preset's, until set): fit's default, generate's default
  // max_length, and what save_to_preset records (Keras' `preprocessor.sequence_length = 128`).
  int sequence_length() const { return sequence_length_; }
  void set_sequence_length(int length);
  bool has_tokenizer() const { return tokenizer_ != nullptr; }
  const Tokenizer& tokenizer() const;  // throws when the preset has none
  DeviceMesh* mesh() const { return mesh_.get(); }
  bool is_main_process() const;        // rank 0 of the mesh (or no mesh): the one that prints and writes
  std::string distribution_summary() const;  // the tensor-parallel plan under a mesh, else ""

  // backbone.weights in Keras' order (an int8 layer's scale is a frozen variable of its own), then
  // the LoRA variables once enable_lora was called; with a distribution, each with its sharding.
  std::vector<VariableInfo> variables() const;
  ParameterSummary summary() const;
  // The same table for a mesh of `shape` (no processes needed): the `info --mesh` dry run.
  std::vector<VariableInfo> variables_on(const DistributionOptions& dry_run, bool with_sharding = true) const;

  // backbone.enable_lora(rank): the base freezes, query and value (or `targets`) get adapters.
  void enable_lora(const LoraOptions& options = {});
  // Continue from an adapter (Keras .lora.h5 or a PEFT directory): enables LoRA at its rank.
  void load_lora_weights(const std::string& path);
  // The trained adapter as Keras' .lora.h5 (a PEFT-style adapter with a B per head cannot be
  // written there: an error) and as a PEFT directory (adapter_config.json + safetensors).
  void save_lora_weights(const std::string& path) const;
  void save_peft_adapter(const std::string& dir) const;
  bool keras_lora_layout() const;  // the adapter can be written as Keras' .lora.h5
  const LoraWeights* lora() const;

  std::vector<GeneratedText> generate(const std::vector<std::string>& prompts, GenerateOptions options) const;
  // generate's defaults: max_length = the preset's sequence_length, the preset's stop tokens.
  GenerateOptions default_generate_options() const;
  // Scores whole sequences: hidden states after the final norm [B·T, D] and logits into the
  // caller's [B·T, V] floats (either output may be null: the logits are the large one, written once
  // where the caller wants them). mask: 1 = token, 0 = padding ([B·T], empty = all tokens).
  void logits(const std::vector<int32_t>& ids, const std::vector<int32_t>& mask, int64_t B, int64_t T,
              std::vector<float>* hidden, float* logits) const;

  void compile(const CompileOptions& options);
  // Trains on `data` (texts, prompt/response pairs, conversations or token ids); may be called
  // again: a later fit continues from the step reached with the same optimizer state.
  History fit(const Dataset& data, const FitRunOptions& run, const std::vector<Callback*>& callbacks = {});
  // Keras' stop_training: the running fit stops after its current step (every process together).
  void stop_training() { stop_->store(true); }
  // Mean loss and accuracy over `data` without updating anything.
  EpochMetrics evaluate(const Dataset& data, const FitRunOptions& run) const;
  long long trainable_count() const;
  size_t held_weight_bytes() const;  // weight bytes this process holds (what sharding saves)
  // Training at `batch_size` rows of `sequence_length` (0: the preprocessor's), as fit would run it:
  // LoRA when enabled, else every weight. fit refuses a run whose estimate exceeds the memory the
  // process may use (core/memory.h), naming the flags; `info` prints it.
  MemoryEstimate training_memory(int batch_size, int sequence_length = 0) const;

  // The current weights (LoRA merged) as a Keras preset or a Hugging Face checkpoint. Under a mesh
  // every process must call it (split variables are gathered); rank 0 writes.
  void save_to_preset(const std::string& dir) const;
  void export_model(const std::string& format, const std::string& dir) const;  // "keras" or "hf"
  // Puts the trained weights of a finetune checkpoint (one file or a sharded run's manifest) into
  // this model (LoRA merged); returns the step it was written at.
  int64_t apply_checkpoint(const std::string& path);

 private:
  GemmaCausalLM() = default;
  std::ostream& notes() const;
  void check_before_fit(const char* what) const;
  GemmaModel inference_model() const;  // what generate/logits compute with now
  Context context() const;             // how: the backend, the policy's precision, this process' group
  GemmaModel current_model() const;    // whole, LoRA merged (gathers under a mesh)
  BatchStream batches(const Dataset& data, const FitRunOptions& run, bool shuffle) const;

  PresetOptions options_;
  std::unique_ptr<Backend> backend_;
  MatmulPrecision precision_ = MatmulPrecision::F32;  // the dtype policy's matmul inputs
  ModelDir dir_;
  GemmaConfig config_;  // the whole model's
  int sequence_length_ = 0;
  std::vector<DType> stored_dtypes_;  // each variable's as loaded, in gemma_variables order
  std::unique_ptr<Tokenizer> tokenizer_;
  // A mesh of GPUs' collectives (NCCL over world(), or the device-tagged one of reference-device);
  // declared before the mesh, whose axis communicators are split from it, so it outlives them.
  std::unique_ptr<Communicator> device_comm_;
  std::unique_ptr<DeviceMesh> mesh_;
  Distribution distribution_;
  TensorParallelPlan plan_;
  // The weights: `model_` as loaded until the first fit (under a mesh `sharded_` holds them once
  // generate needed the compute model), then the trainer's.
  GemmaModel model_;
  mutable std::unique_ptr<ShardedModel> sharded_;  // made on first use by inference_model (a cache)
  // A device backend's copy of the model inference last used, and the host model it was made from
  // (uploaded again when its matrices change: another adapter merged, weights replaced).
  mutable std::optional<GemmaModel> uploaded_;
  mutable GemmaModel uploaded_source_;
  GemmaModel on_backend(const GemmaModel& host) const;
  std::unique_ptr<LoraWeights> attached_;  // an adapter loaded with the preset kept as low-rank terms (int8 base)
  bool base_rounded_to_bf16_ = false;      // the policy stored the matrices as bf16 at load
  std::optional<LoraWeights> lora_;        // enabled for training
  std::optional<CompileOptions> compiled_;
  std::unique_ptr<Trainer> trainer_;  // made by the first fit
  std::unique_ptr<std::atomic<bool>> stop_ = std::make_unique<std::atomic<bool>>(false);
};

// Parsing helpers shared by the command line and the bindings.
std::vector<std::string> split_commas(const std::string& text);

}  // namespace meshtune::api
