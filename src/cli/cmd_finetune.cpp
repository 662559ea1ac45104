// meshtune finetune MODEL --data SPEC [--lora-rank R | --full] ... --out DIR
// The tutorial's enable_lora → compile(AdamW) → fit(data) → generate, in one command. Writes to
// --out: checkpoint.safetensors (resumable), and at the end the LoRA adapter as Keras
// `adapter.lora.h5` and as a PEFT directory `adapter/`, or for --full a Keras preset `model/`.
#include <algorithm>
#include <chrono>
#include <malloc.h>

#include <csignal>
#include <cstdlib>
#include <memory>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <nlohmann/json.hpp>

#include "cli/loading.h"
#include "cli/mesh_options.h"
#include "core/error.h"
#include "distribution/communicator.h"
#include "data/batches.h"
#include "generate/generate.h"
#include "store/lora_files.h"
#include "store/save.h"
#include "train/run_dir.h"
#include "train/trainer.h"

namespace meshtune::cli {

static std::atomic<bool> g_stop{false};

// Bytes currently allocated through malloc (glibc's mallinfo2: small blocks plus mmap'd ones).
static size_t allocated_bytes() {
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
}
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

static std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

Runner add_finetune_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("finetune", "Fine-tune with LoRA (default rank 4) or all parameters (--full)");
  struct Options {
    ModelOptions model;
    std::string data, validation_data, out = "runs/finetune";
    DataFields fields;
    size_t take = 0, validation_take = 0;
    uint64_t shuffle_seed = 0;
    bool no_shuffle = false, full = false, resume = false, overwrite = false, no_progress = false, epochs_given = false;
    int seq_len = 128, batch_size = 2, epochs = 1, grad_accum = 1, lora_rank = 0;
    int64_t steps = 0, checkpoint_every = 0, warmup_steps = 0;
    double lora_alpha = 0, lr = 5e-5, weight_decay = 0.01, beta_1 = 0.9, beta_2 = 0.999, epsilon = 1e-7;
    double clipnorm = 0, clipvalue = 0, global_clipnorm = 0, final_lr_fraction = 0;
    std::string lora_targets = "query,value", lora_init, no_decay, schedule = "constant", log_jsonl, train_on = "responses";
    uint64_t lora_seed = 0;
    std::vector<std::string> sample_prompts;
    int sample_max_length = 64;
    MeshOptions mesh;
  };
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
  return [o] {
    namespace fs = std::filesystem;
    check(o->seq_len >= 1, "--seq-len must be at least 1, got ", o->seq_len);
    check(o->batch_size >= 1, "--batch-size must be at least 1, got ", o->batch_size);
    check(o->epochs >= 1, "--epochs must be at least 1, got ", o->epochs);
    check(o->steps >= 0, "--steps must not be negative, got ", o->steps);
    check(!(o->full && (o->lora_rank > 0 || !o->lora_init.empty())), "--full cannot be combined with LoRA options");
    check(!(o->resume && o->overwrite), "--resume and --overwrite cannot be combined");
    const RunDirMode run_mode = o->resume ? RunDirMode::Resume : o->overwrite ? RunDirMode::Overwrite : RunDirMode::Fresh;
    if (run_mode != RunDirMode::Overwrite) prepare_run_dir(o->out, run_mode);  // refuse before any loading
    // Pre-tokenized data needs no tokenizer (unless samples are asked for).
    const bool pretokenized = o->data.rfind("npy:", 0) == 0 ||
                              (o->data.size() > 4 && o->data.compare(o->data.size() - 4, 4, ".npy") == 0);
    // Under a mesh each process reads only its blocks of the weights the layout splits.
    check(o->model.dtype_policy != "bfloat16",
          "--dtype-policy bfloat16 keeps the variables in bf16 (Keras' set_floatx(\"bfloat16\"), for inference); train "
          "with mixed_bfloat16: fp32 variables and optimizer state, bf16 matmuls");
    o->model.trains_weights = o->full;
    std::unique_ptr<DeviceMesh> mesh = o->mesh.make_mesh();
    Distribution distribution;
    if (mesh)
      distribution = o->mesh.make_distribution(
          mesh.get(), read_config(o->model));
    LoadedModel loaded =
        load_model_and_tokenizer(o->model, !pretokenized || !o->sample_prompts.empty() || !o->validation_data.empty(),
                                 mesh ? sharded_loading(distribution.layout, *mesh) : LoadOptions{});
    const GemmaConfig config = loaded.model.config;
    check(!(o->full && loaded.model.has_int8()), o->model.model,
          ": int8 weights are frozen (as in Keras): train them with LoRA (--lora-rank), not --full");
    check(o->seq_len <= config.max_sequence_length, "--seq-len ", o->seq_len, " exceeds the model's maximum sequence length ",
          config.max_sequence_length);

    Dataset dataset = load_dataset(o->data, o->fields);
    BatchOptions batch_options;
    batch_options.sequence_length = o->seq_len;
    batch_options.batch_size = o->batch_size;
    batch_options.take = o->take;
    batch_options.shuffle = !o->no_shuffle;
    batch_options.shuffle_seed = o->shuffle_seed;
    batch_options.train_on_all_turns = o->train_on == "all";
    BatchStream stream(dataset, loaded.tokenizer.get(), batch_options);

    std::optional<LoraWeights> lora;
    if (!o->full) {
      if (!o->lora_init.empty()) {
        lora = load_lora_adapter(o->lora_init, config);
        check(o->lora_rank == 0 || o->lora_rank == lora->rank, o->lora_init, ": adapter rank ", lora->rank,
              " differs from --lora-rank ", o->lora_rank);
      } else {
        lora = enable_lora(config, o->lora_rank > 0 ? o->lora_rank : 4,
                           parse_lora_targets(split_commas(o->lora_targets)), o->lora_seed, o->lora_alpha);
      }
    }
    FitOptions fit;
    fit.epochs = o->steps > 0 && !o->epochs_given ? 0 : o->epochs;  // 0: as many as --steps needs
    fit.max_steps = o->steps;
    fit.grad_accumulation = o->grad_accum;
    fit.adamw.learning_rate = o->lr;
    fit.adamw.weight_decay = o->weight_decay;
    fit.adamw.beta_1 = o->beta_1;
    fit.adamw.beta_2 = o->beta_2;
    fit.adamw.epsilon = o->epsilon;
    fit.adamw.exclude_from_weight_decay = split_commas(o->no_decay);
    fit.adamw.clipnorm = o->clipnorm;
    fit.adamw.clipvalue = o->clipvalue;
    fit.adamw.global_clipnorm = o->global_clipnorm;
    const int64_t steps_per_epoch = (int64_t(stream.steps_per_epoch()) + o->grad_accum - 1) / std::max(1, o->grad_accum);
    fit.schedule.kind = o->schedule;
    fit.schedule.base = o->lr;
    fit.schedule.warmup_steps = o->warmup_steps;
    fit.schedule.total_steps = fit.epochs == 0 ? o->steps
                               : o->steps > 0 ? std::min<int64_t>(o->steps, steps_per_epoch * o->epochs)
                                              : steps_per_epoch * o->epochs;
    fit.schedule.final_fraction = o->final_lr_fraction;
    if (run_mode == RunDirMode::Overwrite) {  // once every input has loaded: rank 0 clears, the others wait
      if (world().rank() == 0) prepare_run_dir(o->out, run_mode);
      world().barrier();
    }
    fit.checkpoint_path = (fs::path(o->out) / "checkpoint.safetensors").string();
    fit.checkpoint_every = o->checkpoint_every;
    const bool main_process = !mesh || mesh->comm().rank() == 0;
    // Logging sinks: the progress bar and the JSONL log on the first process only.
    std::vector<std::unique_ptr<TrainingLog>> logs;
    if (main_process && !o->no_progress) logs.push_back(std::make_unique<ProgressLog>(stderr));
    if (main_process && !o->log_jsonl.empty()) logs.push_back(std::make_unique<JsonlLog>(o->log_jsonl));
    // Test hook for the resume tests: a real SIGKILL right after a given step's checkpoint
    // (MESHTUNE_TEST_KILL_RANK: only that rank dies).
    if (const char* kill = std::getenv("MESHTUNE_TEST_KILL_AFTER_STEP")) {
      const char* rank = std::getenv("MESHTUNE_TEST_KILL_RANK");
      if (!rank || world().rank() == std::atoi(rank)) logs.push_back(std::make_unique<KillAfterCheckpoint>(std::atoll(kill)));
    }
    std::vector<TrainingLog*> log_sinks;
    for (const auto& log : logs) log_sinks.push_back(log.get());
    const size_t one_device_bytes =
        size_t(config.num_parameters()) * (loaded.model.embeddings.dtype == DType::BF16 ? 2 : 4);
    const std::vector<int> stop_ids =
        loaded.tokenizer ? default_stop_token_ids(loaded.model, *loaded.tokenizer) : std::vector<int>{1};
    Trainer trainer(std::move(loaded.model), lora, fit, distribution);
    if (mesh && main_process) std::cerr << "meshtune: " << trainer.plan_summary() << "\n";
    if (main_process)  // what sharding saves, from our tables and from the allocator
      std::cerr << (mesh ? "mesh " + mesh->describe() : std::string("one device")) << ": this process holds "
                << trainer.held_weight_bytes() << " bytes of weights (one device: " << one_device_bytes
                << "); allocator: " << allocated_bytes() << " bytes in use\n";
    if (o->resume) {
      check(fs::exists(fit.checkpoint_path), "--resume: no checkpoint at ", fit.checkpoint_path);
      trainer.load_checkpoint(fit.checkpoint_path);
      if (main_process) std::cerr << "resumed from " << fit.checkpoint_path << " at step " << trainer.step() << "\n";
    }
    const long long total = config.num_parameters();
    if (main_process) std::cerr << (lora ? "LoRA rank " + std::to_string(lora->rank) : std::string("full fine-tuning"))
              << ": trainable params " << trainer.trainable_count() << ", non-trainable "
              << (lora ? total : 0) << "; " << stream.num_examples() << " examples, " << steps_per_epoch
              << " steps per epoch\n";

    GenerateOptions sample;
    sample.max_length = o->sample_max_length;
    sample.stop_token_ids = stop_ids;
    auto print_samples = [&](const char* when) {
      if (o->sample_prompts.empty()) return;
      GemmaModel m = trainer.inference_model();
      for (const GeneratedText& r : generate_text(m, *loaded.tokenizer, o->sample_prompts, sample))
        if (main_process) std::cout << when << ": " << r.text << "\n" << std::flush;
    };
    print_samples("before");

    g_stop.store(false);
    std::signal(SIGINT, request_stop);
    std::signal(SIGTERM, request_stop);
    const auto fit_start = std::chrono::steady_clock::now();
    EpochMetrics metrics = trainer.fit(stream, log_sinks, &g_stop);
    const double train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - fit_start).count();
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);
    if (trainer.interrupted()) {
      if (main_process) std::cerr << "interrupted: saved " << fit.checkpoint_path << " at step " << trainer.step()
                << "; continue with --resume\n";
      return 130;
    }

    if (lora && main_process) {
      // Every format the adapter can be written in. A PEFT-style adapter (continued with
      // --lora-init from a PEFT directory) has one B per head, which Keras' layout cannot hold.
      const LoraWeights& trained = *trainer.lora();
      const bool keras_style = std::all_of(trained.adapters.begin(), trained.adapters.end(),
                                           [](const LoraAdapter& a) { return a.style == LoraStyle::Keras; });
      save_peft_adapter((fs::path(o->out) / "adapter").string(), config, trained,
                        fs::absolute(loaded.dir.path).lexically_normal().string());
      if (keras_style) {
        save_keras_lora((fs::path(o->out) / "adapter.lora.h5").string(), config, trained);
        std::cerr << "wrote " << o->out << "/adapter.lora.h5 (Keras) and " << o->out << "/adapter/ (PEFT)\n";
      } else {
        std::cerr << "wrote " << o->out << "/adapter/ (PEFT); skipped adapter.lora.h5: a PEFT-style adapter (from "
                  << o->lora_init << ") has a B matrix per head, which Keras' save_lora_weights layout cannot hold\n";
      }
    } else if (!lora) {
      GemmaModel final_model = trainer.current_model();  // every process takes part in the gathers
      if (main_process) {
        save_keras_preset(final_model, loaded.dir.tokenizer_path, o->seq_len, (fs::path(o->out) / "model").string());
        std::cerr << "wrote " << o->out << "/model (Keras preset)\n";
      }
    }
    nlohmann::json result = {{"steps", trainer.step()}, {"loss", metrics.loss}, {"accuracy", metrics.accuracy},
                             {"trainable_params", trainer.trainable_count()},
                             {"train_seconds", train_seconds}, {"collective_seconds", collective_seconds()}};
    if (!o->validation_data.empty()) {  // every process evaluates (the same numbers)
      BatchOptions vo = batch_options;
      vo.shuffle = false;
      vo.take = o->validation_take;
      BatchStream validation(load_dataset(o->validation_data, o->fields), loaded.tokenizer.get(), vo);
      EpochMetrics v = trainer.evaluate(validation);
      result["val_loss"] = v.loss;
      result["val_accuracy"] = v.accuracy;
      if (main_process) std::cerr << "validation: loss " << v.loss << " - sparse_categorical_accuracy " << v.accuracy << "\n";
    }
    print_samples("after");
    if (main_process) std::cout << result.dump() << "\n";
    return 0;
  };
}

}  // namespace meshtune::cli
