// meshtune finetune MODEL --data SPEC [--lora-rank R | --full] ... --out DIR
// The tutorial's enable_lora → compile(AdamW) → fit(data) → generate, in one command. Writes to
// --out: checkpoint.safetensors (resumable), and at the end the LoRA adapter as Keras
// `adapter.lora.h5` and as a PEFT directory `adapter/`, or for --full a Keras preset `model/`.
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/mesh_options.h"
#include "core/error.h"
#include "distribution/collectives.h"
#include "distribution/communicator.h"
#include "train/run_dir.h"

namespace meshtune::cli {

static std::atomic<bool> g_stop{false};

static void request_stop(int) { g_stop.store(true); }

// The resume tests' hook (MESHTUNE_TEST_KILL_AFTER_STEP): SIGKILL, as a crash would, right after
// the given step's checkpoint is written.
class KillAfterCheckpoint : public TrainingLog {
 public:
  explicit KillAfterCheckpoint(int64_t step) : step_(step) {}
  void checkpoint_saved(int64_t step, const std::string&) override {
    if (step == step_) std::raise(SIGKILL);
  }

 private:
  int64_t step_;
};

namespace {
struct Options {
    ModelOptions model;
    std::string data, validation_data, out = "runs/finetune";
    DataFields fields;
    size_t take = 0, validation_take = 0;
    uint64_t shuffle_seed = 0;
    bool no_shuffle = false, full = false, resume = false, overwrite = false, no_progress = false, epochs_given = false;
    int seq_len = 128, batch_size = 2, epochs = 1, grad_accum = 1;
    std::optional<int> lora_rank;  // unset: 4 (LoRA), none (--full)
    int64_t steps = 0, checkpoint_every = 0, warmup_steps = 0;
    double lora_alpha = 0, lr = 5e-5, weight_decay = 0.01, beta_1 = 0.9, beta_2 = 0.999, epsilon = 1e-7;
    std::optional<double> clipnorm, clipvalue, global_clipnorm;  // unset: no clipping (Keras' None)
    double final_lr_fraction = 0;
    std::string lora_targets = "query,value", lora_init, no_decay, schedule = "constant", log_jsonl, train_on = "responses";
    uint64_t lora_seed = 0;
    std::vector<std::string> sample_prompts;
    int sample_max_length = 64;
    MeshOptions mesh;
  };
}  // namespace

static int run_finetune(const Options& o);

Runner add_finetune_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("finetune", "Fine-tune with LoRA (default rank 4) or all parameters (--full)");
  auto o = std::make_shared<Options>();
  o->model.add_to(*cmd, /*with_lora=*/false);
  o->model.add_dtype_policy(*cmd);
  cmd->add_option("--data", o->data, "Training data: tfrecord:|aclimdb:|jsonl:|text:|npy:PATH (kind detected if omitted)")
      ->required();
  cmd->add_option("--text-field", o->fields.text, "JSONL field holding the text (default text)");
  cmd->add_option("--prompt-field", o->fields.prompt,
                  "JSONL field of a prompt/response pair's prompt (default prompts, also prompt); the loss is on "
                  "the response only");
  cmd->add_option("--train-on", o->train_on,
                  "Conversations ({\"messages\": [...]}): the loss on the model turns (responses, default) or on every "
                  "token (all)")
      ->check(CLI::IsMember({"responses", "all"}));
  cmd->add_option("--response-field", o->fields.response,
                  "JSONL field of a prompt/response pair's response (default responses, also response)");
  cmd->add_option("--take", o->take, "Use only the first N examples (the tutorial's .take(2000))");
  cmd->add_option("--shuffle-seed", o->shuffle_seed, "Seed of the per-epoch shuffle (default 0)");
  cmd->add_flag("--no-shuffle", o->no_shuffle, "Keep the data in file order");
  cmd->add_option("--seq-len", o->seq_len, "Preprocessor sequence_length (default 128)");
  cmd->add_option("--batch-size", o->batch_size, "Batch size (default 2)");
  cmd->add_option_function<int>(
      "--epochs", [o](int n) { o->epochs = n, o->epochs_given = true; },
      "Epochs (default 1; with --steps: whichever ends first)");
  cmd->add_option("--steps", o->steps,
                  "Run this many optimizer steps, cycling the data for as many epochs as that takes (Hugging Face "
                  "max_steps); with --epochs too, whichever ends first");
  cmd->add_option("--grad-accum", o->grad_accum, "Micro-batches per optimizer step (default 1)");
  cmd->add_option("--lora-rank", o->lora_rank, "LoRA rank (default 4 unless --full)");
  cmd->add_option("--lora-alpha", o->lora_alpha, "LoRA alpha (default = rank, scale 1, as Keras)");
  cmd->add_option("--lora-targets", o->lora_targets,
                  "Comma list of query,key,value,attention_output,ffw_gating,ffw_gating_2,ffw_linear or all (default query,value)");
  cmd->add_option("--lora-init", o->lora_init, "Continue from an adapter (.lora.h5 or a PEFT directory)");
  cmd->add_option("--lora-seed", o->lora_seed, "Seed of the LoRA A initialisation (default 0)");
  cmd->add_flag("--full", o->full, "Train all parameters instead of LoRA");
  cmd->add_option("--lr", o->lr, "Learning rate (default 5e-5)");
  cmd->add_option("--weight-decay", o->weight_decay, "AdamW weight decay (default 0.01)");
  cmd->add_option("--no-decay", o->no_decay, "Comma list of variable names excluded from decay (regex search, Keras), e.g. bias,scale");
  cmd->add_option("--beta1", o->beta_1, "AdamW beta_1 (default 0.9)");
  cmd->add_option("--beta2", o->beta_2, "AdamW beta_2 (default 0.999)");
  cmd->add_option("--epsilon", o->epsilon, "AdamW epsilon (default 1e-7)");
  cmd->add_option("--clipnorm", o->clipnorm, "Clip each gradient to this norm");
  cmd->add_option("--clipvalue", o->clipvalue, "Clip gradient values to ±this");
  cmd->add_option("--global-clipnorm", o->global_clipnorm, "Clip all gradients to this global norm");
  cmd->add_option("--schedule", o->schedule, "constant (default), linear or cosine decay")
      ->check(CLI::IsMember({"constant", "linear", "cosine"}));
  cmd->add_option("--warmup-steps", o->warmup_steps, "Linear warm-up steps (default 0)");
  cmd->add_option("--final-lr-fraction", o->final_lr_fraction, "Decay to this fraction of --lr (default 0)");
  cmd->add_option("--out", o->out, "Output directory (default runs/finetune)");
  cmd->add_option("--checkpoint-every", o->checkpoint_every, "Also save a checkpoint every N steps");
  cmd->add_flag("--resume", o->resume, "Continue from --out/checkpoint.safetensors");
  cmd->add_flag("--overwrite", o->overwrite,
                "Replace the run already in --out (its checkpoint, adapter and model are removed first); "
                "without it or --resume such a directory is refused");
  cmd->add_option("--log-jsonl", o->log_jsonl, "Write one JSON line per step (step, loss, accuracy, lr, tokens/s)");
  cmd->add_option("--validation-data", o->validation_data, "Evaluate on this data after training");
  cmd->add_option("--validation-take", o->validation_take, "Use only the first N validation examples");
  cmd->add_flag("--no-progress", o->no_progress, "No progress bar");
  cmd->add_option("--sample-prompt", o->sample_prompts, "Generate from this prompt before and after training");
  cmd->add_option("--sample-max-length", o->sample_max_length, "max_length for --sample-prompt (default 64)");
  o->mesh.add_to(*cmd);
  return [o] { return run_finetune(*o); };
}

// compile(optimizer=AdamW(...)) and fit(...)'s options from the flags.
static api::CompileOptions compile_options(const Options& o) {
  api::CompileOptions compile;
  compile.learning_rate = o.lr;
  compile.weight_decay = o.weight_decay;
  compile.beta_1 = o.beta_1;
  compile.beta_2 = o.beta_2;
  compile.epsilon = o.epsilon;
  compile.exclude_from_weight_decay = api::split_commas(o.no_decay);
  compile.clipnorm = o.clipnorm.value_or(0);
  compile.clipvalue = o.clipvalue.value_or(0);
  compile.global_clipnorm = o.global_clipnorm.value_or(0);
  compile.schedule = o.schedule;
  compile.warmup_steps = o.warmup_steps;
  compile.final_lr_fraction = o.final_lr_fraction;
  return compile;
}

static api::FitRunOptions run_options(const Options& o) {
  api::FitRunOptions run;
  run.epochs = o.steps > 0 && !o.epochs_given ? 0 : o.epochs;  // 0: as many as --steps needs
  run.steps = o.steps;
  run.batch_size = o.batch_size;
  run.grad_accumulation = o.grad_accum;
  run.take = o.take;
  run.shuffle = !o.no_shuffle;
  run.shuffle_seed = o.shuffle_seed;
  run.train_on_all_turns = o.train_on == "all";
  run.checkpoint_path = (std::filesystem::path(o.out) / "checkpoint.safetensors").string();
  run.checkpoint_every = o.checkpoint_every;
  run.resume = o.resume;
  return run;
}

// The trained adapter in every format it can be written in (a PEFT-style one, continued with
// --lora-init from a PEFT directory, has one B per head, which Keras' layout cannot hold), or for
// --full the whole model as a Keras preset. Every process takes part (gathers under a mesh).
static void save_outputs(const api::GemmaCausalLM& lm, const Options& o) {
  namespace fs = std::filesystem;
  const bool main_process = lm.is_main_process();
  if (!lm.lora()) {
    lm.save_to_preset((fs::path(o.out) / "model").string());
    if (main_process) std::cerr << "wrote " << o.out << "/model (Keras preset)\n";
    return;
  }
  lm.save_peft_adapter((fs::path(o.out) / "adapter").string());
  if (lm.keras_lora_layout()) {
    lm.save_lora_weights((fs::path(o.out) / "adapter.lora.h5").string());
    if (main_process) std::cerr << "wrote " << o.out << "/adapter.lora.h5 (Keras) and " << o.out << "/adapter/ (PEFT)\n";
  } else if (main_process) {
    std::cerr << "wrote " << o.out << "/adapter/ (PEFT); skipped adapter.lora.h5: a PEFT-style adapter (from "
              << o.lora_init << ") has a B matrix per head, which Keras' save_lora_weights layout cannot hold\n";
  }
}

// Callbacks: the progress bar and the JSONL log on the first process only, and the resume tests'
// SIGKILL hook (MESHTUNE_TEST_KILL_AFTER_STEP; MESHTUNE_TEST_KILL_RANK: only that rank dies).
static std::vector<std::unique_ptr<TrainingLog>> make_callbacks(const Options& o, bool main_process) {
  std::vector<std::unique_ptr<TrainingLog>> logs;
  if (main_process && !o.no_progress) logs.push_back(std::make_unique<ProgressLog>(stderr));
  if (main_process && !o.log_jsonl.empty()) logs.push_back(std::make_unique<JsonlLog>(o.log_jsonl));
  if (const char* kill = std::getenv("MESHTUNE_TEST_KILL_AFTER_STEP")) {
    const char* rank = std::getenv("MESHTUNE_TEST_KILL_RANK");
    if (!rank || world().rank() == std::atoi(rank)) logs.push_back(std::make_unique<KillAfterCheckpoint>(std::atoll(kill)));
  }
  return logs;
}

// The finetune recipe over the library: load (sharded under a mesh), enable_lora, compile, fit,
// then the adapter (or the whole model) written into --out.
static int run_finetune(const Options& o) {
  namespace fs = std::filesystem;
  check(o.seq_len >= 1, "--seq-len must be at least 1, got ", o.seq_len);
  check(o.batch_size >= 1, "--batch-size must be at least 1, got ", o.batch_size);
  check(o.epochs >= 1, "--epochs must be at least 1, got ", o.epochs);
  check(o.steps >= 0, "--steps must not be negative, got ", o.steps);
  check(!o.lora_rank || *o.lora_rank >= 1, "--lora-rank must be at least 1, got ", o.lora_rank.value_or(0));
  for (const auto& [flag, value] : {std::pair{"--clipnorm", o.clipnorm}, {"--clipvalue", o.clipvalue},
                                    {"--global-clipnorm", o.global_clipnorm}})
    check(!value || (std::isfinite(*value) && *value > 0), flag, " must be finite and > 0 (leave it out for no clipping), got ",
          value.value_or(0));
  check(!(o.full && (o.lora_rank || !o.lora_init.empty())), "--full cannot be combined with LoRA options");
  check(!(o.resume && o.overwrite), "--resume and --overwrite cannot be combined");
  check(o.model.dtype_policy != "bfloat16",
        "--dtype-policy bfloat16 keeps the variables in bf16 (Keras' set_floatx(\"bfloat16\"), for inference); train "
        "with mixed_bfloat16: fp32 variables and optimizer state, bf16 matmuls");
  const RunDirMode run_mode = o.resume ? RunDirMode::Resume : o.overwrite ? RunDirMode::Overwrite : RunDirMode::Fresh;
  // One run per directory: the first process (the one that writes the shared files) holds its lock
  // for the whole run, taken before the directory is checked.
  std::optional<RunDirLock> lock;
  if (world().rank() == 0) lock.emplace(o.out);
  if (run_mode != RunDirMode::Overwrite) prepare_run_dir(o.out, run_mode);  // refuse before any loading
  // Pre-tokenized data needs no tokenizer (unless samples or validation are asked for).
  const bool pretokenized = o.data.rfind("npy:", 0) == 0 ||
                            (o.data.size() > 4 && o.data.compare(o.data.size() - 4, 4, ".npy") == 0);
  api::PresetOptions preset = o.model.preset();
  preset.train_all_weights = o.full;
  preset.need_tokenizer = !pretokenized || !o.sample_prompts.empty() || !o.validation_data.empty();
  preset.distribution = o.mesh.distribution();
  api::GemmaCausalLM lm = api::GemmaCausalLM::from_preset(o.model.model, preset);
  lm.set_sequence_length(o.seq_len);
  const Dataset dataset = load_dataset(o.data, o.fields);
  if (!o.full) {
    if (!o.lora_init.empty()) {
      lm.load_lora_weights(o.lora_init);
      check(!o.lora_rank || *o.lora_rank == lm.lora()->rank, o.lora_init, ": adapter rank ", lm.lora()->rank,
            " differs from --lora-rank ", o.lora_rank.value_or(0));
    } else {
      lm.enable_lora({o.lora_rank.value_or(4), api::split_commas(o.lora_targets), o.lora_alpha, o.lora_seed});
    }
  }
  lm.compile(compile_options(o));
  api::FitRunOptions run = run_options(o);
  if (run_mode == RunDirMode::Overwrite) {  // once every input has loaded: rank 0 clears, the others wait
    if (world().rank() == 0) prepare_run_dir(o.out, run_mode);
    world().barrier();
  }
  const bool main_process = lm.is_main_process();
  const std::vector<std::unique_ptr<TrainingLog>> logs = make_callbacks(o, main_process);
  std::vector<api::Callback*> callbacks;
  for (const auto& log : logs) callbacks.push_back(log.get());

  GenerateOptions sample = lm.default_generate_options();
  sample.max_length = o.sample_max_length;
  auto print_samples = [&](const char* when) {
    if (o.sample_prompts.empty()) return;
    for (const GeneratedText& r : lm.generate(o.sample_prompts, sample))
      if (main_process) std::cout << when << ": " << r.text << "\n" << std::flush;
  };
  print_samples("before");

  g_stop.store(false);
  std::signal(SIGINT, request_stop);
  std::signal(SIGTERM, request_stop);
  run.stop_signal = &g_stop;
  const api::History history = lm.fit(dataset, run, callbacks);
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  if (history.interrupted) {
    if (main_process)
      std::cerr << "interrupted: saved " << run.checkpoint_path << " at step " << history.steps
                << "; continue with --resume\n";
    return 130;
  }
  save_outputs(lm, o);
  nlohmann::json result = {{"steps", history.steps},
                           {"loss", history.loss.empty() ? 0.0 : history.loss.back()},
                           {"accuracy", history.accuracy.empty() ? 0.0 : history.accuracy.back()},
                           {"trainable_params", history.trainable_params},
                           {"train_seconds", history.train_seconds},
                           {"collective_seconds", collective_seconds()}};
  if (!o.validation_data.empty()) {  // every process evaluates (the same numbers)
    api::FitRunOptions validation = run;
    validation.take = o.validation_take;
    const EpochMetrics v = lm.evaluate(load_dataset(o.validation_data, o.fields), validation);
    result["val_loss"] = v.loss;
    result["val_accuracy"] = v.accuracy;
    if (main_process) std::cerr << "validation: loss " << v.loss << " - sparse_categorical_accuracy " << v.accuracy << "\n";
  }
  print_samples("after");
  if (main_process) std::cout << result.dump() << "\n";
  return 0;
}

}  // namespace meshtune::cli
