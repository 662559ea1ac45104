// Training against references: the loss and LoRA gradients of an independent PyTorch (fp64)
// implementation, three Keras-AdamW steps, finite differences through the whole model, and an
// interrupted (SIGKILLed) run resumed to bit-identical weights.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "backend/cpu_backend.h"
#include "io/keras_h5.h"
#include "model/backward.h"
#include "model/init.h"
#include "store/load.h"
#include "store/lora_files.h"
#include "model/lora.h"
#include "npz_reader.h"
#include "cpu_path_test.h"
#include "test_util.h"
#include "text/preprocessor.h"
#include "train/run_dir.h"
#include "train/trainer.h"

using namespace meshtune;
using namespace meshtune::testing;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// The fixture batch: x = tokens[:, :-1], y = tokens[:, 1:], w = mask[:, 1:], keys = mask[:, :-1].
Batch fixture_batch(const std::map<std::string, NpzArray>& npz) {
  const NpzArray& tokens = npz.at("tokens");
  const NpzArray& mask = npz.at("mask");
  Batch b;
  b.batch_size = tokens.shape[0];
  b.seq_len = tokens.shape[1] - 1;
  for (int64_t r = 0; r < b.batch_size; ++r)
    for (int64_t t = 0; t < b.seq_len; ++t) {
      const int64_t i = r * tokens.shape[1] + t;
      b.token_ids.push_back(int32_t(tokens.values[i]));
      b.targets.push_back(int32_t(tokens.values[i + 1]));
      b.padding_mask.push_back(uint8_t(mask.values[i] != 0));
      b.sample_weight.push_back(float(mask.values[i + 1]));
    }
  return b;
}

// LoRA adapters holding the fixture's A and B for q_proj / v_proj of every layer.
LoraWeights fixture_lora(const std::map<std::string, NpzArray>& npz, const GemmaConfig& c, LoraStyle style) {
  LoraWeights lora;
  lora.rank = 4;
  lora.alpha = 4;
  for (int layer = 0; layer < c.num_layers; ++layer)
    for (auto [slot, proj] : {std::pair{Slot::Query, "q_proj"}, std::pair{Slot::Value, "v_proj"}}) {
      const std::string name = "model.layers." + std::to_string(layer) + ".self_attn." + proj;
      LoraAdapter a;
      a.layer = layer;
      a.slot = slot;
      a.style = style;
      a.rank = 4;
      const NpzArray& A = npz.at(name + ".lora_A");
      const NpzArray& B = npz.at(name + ".lora_B");
      a.a_shape = Shape(A.shape.begin(), A.shape.end());
      a.b_shape = Shape(B.shape.begin(), B.shape.end());
      a.a.assign(A.values.begin(), A.values.end());
      a.b.assign(B.values.begin(), B.values.end());
      lora.adapters.push_back(a);
    }
  return lora;
}

std::string adapter_key(const GemmaConfig& c, const LoraAdapter& a) {
  (void)c;
  return "model.layers." + std::to_string(a.layer) + ".self_attn." + (a.slot == Slot::Query ? "q_proj" : "v_proj");
}

// On every CPU path this machine has: each path's forward, backward and AdamW against PyTorch.
class TorchLoraFixture : public ::testing::TestWithParam<std::tuple<std::string, CpuPath>> {};

TEST_P(TorchLoraFixture, LossGradientsAndAdamStepsMatchPyTorch) {
  const auto& [style_name, path] = GetParam();
  if (!cpu_supports(path)) GTEST_SKIP() << "this CPU has no " << cpu_path_name(path) << " path";
  const std::unique_ptr<CpuBackend> backend = meshtune::testing::cpu_backend_on(path);
  const auto npz = read_npz(fixture("torch/loragrad_tiny-gemma_" + style_name + ".npz"));
  const LoraStyle style = style_name == "keras" ? LoraStyle::Keras : LoraStyle::Peft;
  GemmaModel base = load_model(inspect_model_dir(fixture("hf/tiny-gemma/checkpoint")));
  const GemmaConfig& c = base.config;
  Batch batch = fixture_batch(npz);

  FitOptions options;
  options.adamw.learning_rate = 1e-2;
  options.adamw.weight_decay = 0.01;
  options.schedule.base = 1e-2;
  Trainer trainer(*backend, MatmulPrecision::F32, base, fixture_lora(npz, c, style), options);

  // Step 1 computes the loss and gradients at the fixture's starting point.
  std::vector<std::vector<float>> before;
  for (const Parameter& p : trainer.parameters()) before.emplace_back(p.value.data, p.value.data + p.size);
  LossSums sums = trainer.train_step(batch, 1e-2);
  const double loss = sums.weighted_ce / double(batch.batch_size * batch.seq_len);
  EXPECT_NEAR(loss, npz.at("loss").values[0], 1e-5 * npz.at("loss").values[0]);
  // The adapters' gradients, A then B of each adapter in order (the trainer's parameters).
  const std::vector<LoraAdapter>& adapters = trainer.lora()->adapters;
  for (size_t k = 0; k < adapters.size(); ++k) {
    const std::string key = adapter_key(c, adapters[k]);
    for (int ab = 0; ab < 2; ++ab) {
      const char* which = ab == 0 ? ".lora_A" : ".lora_B";
      const Parameter& p = trainer.parameters()[2 * k + size_t(ab)];
      const NpzArray& expected = npz.at("grad." + key + which);
      ASSERT_EQ(p.size, expected.values.size()) << key << which;
      const double scale = max_abs(expected.values);
      double worst = 0;
      for (size_t i = 0; i < p.size; ++i) worst = std::max(worst, std::fabs(p.grad.data[i] - expected.values[i]));
      EXPECT_LT(worst, 1e-4 * scale) << key << which << " (max |grad| " << scale << ")";
    }
  }
  // Three Keras-AdamW steps on the same batch: the loss before each step equals adam_losses, and
  // the parameters after step 3 are within 2e-3 of the total update. (In the fixture files the
  // step1/step2 arrays hold the same values as step3 — the final parameters — so only step 3 is
  // comparable; reported in the closing note.)
  for (int step = 2; step <= 3; ++step) {
    LossSums s = trainer.train_step(batch, 1e-2);
    EXPECT_NEAR(s.weighted_ce / double(batch.batch_size * batch.seq_len), npz.at("adam_losses").values[step - 1],
                1e-5 * npz.at("adam_losses").values[step - 1]);
  }
  EXPECT_NEAR(loss, npz.at("adam_losses").values[0], 1e-5 * loss);
  size_t pi = 0;
  for (const LoraAdapter& a : trainer.lora()->adapters) {
    const std::string key = adapter_key(c, a);
    for (auto [values, which] : {std::pair{&a.a, ".lora_A"}, std::pair{&a.b, ".lora_B"}}) {
      const NpzArray& expected = npz.at("step3." + key + which);
      double update = 0, worst = 0;
      for (size_t i = 0; i < values->size(); ++i) {
        update = std::max(update, std::fabs(expected.values[i] - before[pi][i]));
        worst = std::max(worst, std::fabs((*values)[i] - expected.values[i]));
      }
      EXPECT_LE(worst, 2e-3 * update) << key << which << " (update " << update << ")";
      ++pi;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Torch, TorchLoraFixture, ::testing::Combine(::testing::Values("keras", "peft"), kEveryCpuPath),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + cpu_path_name(std::get<1>(info.param));
                         });

// Finite differences of the loss through the whole model (fp32 forward, central differences on
// the largest gradients) for every family: soft-caps, sliding windows, q/k norms, GQA, the tied
// embedding, and LoRA.
class ModelGradient : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelGradient, FullAndLoraGradientsMatchFiniteDifferences) {
  GemmaConfig config = preset_config(GetParam(), 61);
  config.sliding_window_size = 3;
  if (config.family == 2) {
    config.attention_logit_soft_cap = 2.0f;
    config.final_logit_soft_cap = 3.0f;
  }
  GemmaModel model = random_model(config, 11);
  const int64_t B = 2, T = 7;
  std::mt19937 rng(5);
  Batch batch;
  batch.batch_size = B;
  batch.seq_len = T;
  for (int64_t i = 0; i < B * T; ++i) {
    batch.token_ids.push_back(int32_t(rng() % 61));
    batch.targets.push_back(int32_t(rng() % 61));
    const bool pad = i >= B * T - 2;  // row 1 ends with two padding positions
    batch.padding_mask.push_back(uint8_t(!pad));
    batch.sample_weight.push_back(pad ? 0.f : 1.f);
  }
  for (bool use_lora : {false, true}) {
    std::optional<LoraWeights> lora;
    if (use_lora) {
      lora = enable_lora(config, 2, parse_lora_targets({"all"}), 3);
      for (auto& a : lora->adapters)
        for (float& x : a.b) x = float(std::normal_distribution<double>(0, 0.3)(rng));
    }
    FitOptions options;
    Trainer trainer(meshtune::testing::cpu_backend(), MatmulPrecision::F32, model, lora, options);
    auto loss_of = [&] {
      GemmaModel m = trainer.current_model();
      TokenBatch tb{B, T, batch.token_ids.data(), batch.padding_mask.data(), batch.targets.data(), batch.sample_weight.data()};
      return forward_backward(meshtune::testing::cpu_context(), m, tb, 1.0, nullptr).weighted_ce / double(B * T);
    };
    // Analytic gradients (no update: lr 0 and no decay).
    std::vector<Parameter>& params = trainer.parameters();
    {
      FitOptions no_update;
      no_update.adamw.learning_rate = 0;
      no_update.adamw.weight_decay = 0;
    }
    // train_step with learning rate 0 computes the gradients and leaves the weights as they are.
    trainer.train_step(batch, 0.0);
    int checked = 0;
    for (Parameter& p : params) {
      // The entry with the largest gradient in each parameter.
      size_t best = 0;
      for (size_t i = 1; i < p.size; ++i)
        if (std::fabs(p.grad.data[i]) > std::fabs(p.grad.data[best])) best = i;
      const double analytic = p.grad.data[best];
      if (std::fabs(analytic) < 1e-4) continue;
      const float saved = p.value.data[best];
      const float h = 1e-2f * std::max(1.f, std::fabs(saved));
      p.value.data[best] = saved + h;
      const double up = loss_of();
      p.value.data[best] = saved - h;
      const double down = loss_of();
      p.value.data[best] = saved;
      const double numeric = (up - down) / (2.0 * double(h));
      EXPECT_NEAR(numeric, analytic, 3e-2 * std::fabs(analytic) + 2e-4) << p.path << "[" << best << "]";
      ++checked;
    }
    EXPECT_GT(checked, use_lora ? 4 : 10);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ModelGradient, ::testing::Values("tiny", "tiny-gemma2", "tiny-gemma3"),
                         [](const auto& info) { return std::string(info.param == "tiny" ? "Gemma1" : info.param == "tiny-gemma2" ? "Gemma2" : "Gemma3"); });

// Answer-only loss: with prompt/response packing, what the prompt positions' targets are changes no
// gradient at all (weight 0 really is 0), while changing a response target does.
// After the first step, a step of the same shape allocates nothing on the backend — LoRA and full
// fine-tuning, fp32 and mixed_bfloat16 (activations kept in bf16), a Gemma 2 model (soft-caps,
// windows): every activation, the KV cache and the workspaces are kept from step to step.
TEST(Training, AStepOfASeenShapeAllocatesNothingOnTheBackend) {
  GemmaConfig config = preset_config("tiny-gemma2", 61);
  const GemmaModel model = random_model(config, 11);
  const int64_t B = 2, T = 7;
  Batch batch;
  batch.batch_size = B;
  batch.seq_len = T;
  for (int64_t i = 0; i < B * T; ++i) {
    batch.token_ids.push_back(int32_t((i * 7 + 3) % 61));
    batch.targets.push_back(int32_t((i * 5 + 1) % 61));
    batch.padding_mask.push_back(1);
    batch.sample_weight.push_back(i % 5 == 0 ? 0.f : 1.f);
  }
  for (bool use_lora : {false, true})
    for (MatmulPrecision precision : {MatmulPrecision::F32, MatmulPrecision::BF16}) {
      SCOPED_TRACE(std::string(use_lora ? "lora" : "full") + (precision == MatmulPrecision::BF16 ? " bf16" : " fp32"));
      CpuBackend backend;
      std::optional<LoraWeights> lora;
      if (use_lora) lora = enable_lora(config, 2, parse_lora_targets({"all"}), 3);
      Trainer trainer(backend, precision, model, lora, FitOptions{});
      trainer.train_step(batch, 1e-3);
      const size_t after_first = backend.allocations();
      EXPECT_GT(after_first, 0u);
      trainer.train_step(batch, 1e-3);
      trainer.train_step(batch, 1e-3);
      EXPECT_EQ(backend.allocations(), after_first);
    }
}

TEST(AnswerOnlyLoss, PromptTargetsDoNotReachTheGradients) {
  GemmaModel model = random_model(preset_config("tiny-gemma3", 61), 4);
  std::optional<LoraWeights> lora = enable_lora(model.config, 2, parse_lora_targets({"all"}), 3);
  std::mt19937 rng(9);
  for (auto& a : lora->adapters)
    for (float& x : a.b) x = float(std::normal_distribution<double>(0, 0.3)(rng));
  const int L = 12;
  const PackedExample packed = pack_prompt_response({5, 6, 7, 8, 9}, {10, 11, 12}, L, 2, 1, 0);
  auto gradients_for = [&](const std::vector<int32_t>& targets) {
    Batch batch;
    batch.batch_size = 1;
    batch.seq_len = L;
    batch.token_ids = packed.token_ids;
    batch.padding_mask = packed.padding_mask;
    batch.targets = targets;
    batch.sample_weight = packed.sample_weight;
    FitOptions options;
    options.adamw.learning_rate = 0;
    options.adamw.weight_decay = 0;
    Trainer trainer(meshtune::testing::cpu_backend(), MatmulPrecision::F32, model, lora, options);
    trainer.train_step(batch, 0.0);
    std::vector<float> all;
    for (const Parameter& p : trainer.parameters()) all.insert(all.end(), p.grad.data, p.grad.data + p.size);
    return all;
  };
  const std::vector<float> base = gradients_for(packed.targets);
  std::vector<int32_t> other_prompt_targets = packed.targets, other_response_target = packed.targets;
  for (int t = 0; t < L; ++t)
    if (packed.sample_weight[size_t(t)] == 0.f) other_prompt_targets[size_t(t)] = 40 + t;
  for (int t = 0; t < L; ++t)
    if (packed.sample_weight[size_t(t)] == 1.f) { other_response_target[size_t(t)] = 33; break; }
  EXPECT_EQ(gradients_for(other_prompt_targets), base);  // bit for bit
  EXPECT_NE(gradients_for(other_response_target), base);
}

// A run SIGKILLed after step 3 and resumed ends bit-identical to an uninterrupted run.
TEST(Resume, KilledRunResumesBitIdentically) {
  const std::string root = make_temp_dir("resume");
  const std::string model = root + "/tiny";
  ASSERT_EQ(run_meshtune("init " + model).exit_code, 0);
  const std::string common = "finetune " + model + " --data sample --seq-len 16 --batch-size 4 --steps 7 --lr 1e-2 --no-progress --lora-targets all";
  CommandResult full = run_meshtune(common + " --out " + root + "/a");
  ASSERT_EQ(full.exit_code, 0) << full.err;

  CommandResult killed = run_meshtune(common + " --checkpoint-every 1 --out " + root + "/b", "MESHTUNE_TEST_KILL_AFTER_STEP=3");
  EXPECT_EQ(killed.exit_code, 128 + 9) << killed.err;  // a real SIGKILL
  EXPECT_FALSE(fs::exists(root + "/b/adapter.lora.h5"));
  CommandResult resumed = run_meshtune(common + " --out " + root + "/b --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("at step 3"), std::string::npos) << resumed.err;
  EXPECT_EQ(read_text_file(root + "/a/adapter.lora.h5").size(), read_text_file(root + "/b/adapter.lora.h5").size());
  EXPECT_TRUE(read_text_file(root + "/a/adapter/adapter_model.safetensors") ==
              read_text_file(root + "/b/adapter/adapter_model.safetensors"));
  EXPECT_EQ(json::parse(full.out)["loss"], json::parse(resumed.out)["loss"]);
}

// Continuing a Hugging Face (PEFT) adapter: training succeeds, the adapter comes back as PEFT, and
// the Keras file, which cannot hold a PEFT-style adapter, is skipped with a note (exit 0).
TEST(FinetuneCli, ContinuingAPeftAdapterWritesPeft) {
  const std::string root = make_temp_dir("ftpeft");
  ASSERT_EQ(run_meshtune("init --format hf " + root + "/hf").exit_code, 0);
  const std::string train = " --data sample --take 4 --steps 1 --batch-size 2 --seq-len 16 --no-progress --out ";
  ASSERT_EQ(run_meshtune("finetune " + root + "/hf" + train + root + "/first").exit_code, 0);
  CommandResult again = run_meshtune("finetune " + root + "/hf --lora-init " + root + "/first/adapter" + train + root + "/second");
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_TRUE(std::filesystem::exists(root + "/second/adapter/adapter_model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(root + "/second/adapter/adapter_config.json"));
  EXPECT_FALSE(std::filesystem::exists(root + "/second/adapter.lora.h5"));
  EXPECT_NE(again.err.find("skipped adapter.lora.h5"), std::string::npos) << again.err;
  // PEFT's AutoPeftModelForCausalLM finds the base model from the adapter config.
  EXPECT_EQ(json::parse(read_text_file(root + "/second/adapter/adapter_config.json"))["base_model_name_or_path"],
            std::filesystem::absolute(root + "/hf").lexically_normal().string());
  // The written adapter loads and continues again.
  CommandResult third = run_meshtune("finetune " + root + "/hf --lora-init " + root + "/second/adapter" + train + root + "/third");
  EXPECT_EQ(third.exit_code, 0) << third.err;
  std::filesystem::remove_all(root);
}

// --steps N is N optimizer steps (Hugging Face max_steps), cycling the data; with --epochs too,
// whichever ends first. The progress bar counts to N.
TEST(FinetuneCli, StepsCycleTheDataAndEpochsCapThem) {
  const std::string root = make_temp_dir("ftsteps");
  ASSERT_EQ(run_meshtune("init " + root + "/tiny").exit_code, 0);
  { std::ofstream(root + "/two.jsonl") << "{\"text\": \"a fine film\"}\n{\"text\": \"a dull film\"}\n"; }
  const std::string train = "finetune " + root + "/tiny --data " + root + "/two.jsonl --batch-size 2 --seq-len 8 ";
  CommandResult five = run_meshtune(train + "--steps 5 --log-jsonl " + root + "/five.jsonl --out " + root + "/five");
  ASSERT_EQ(five.exit_code, 0) << five.err;
  EXPECT_EQ(json::parse(five.out)["steps"], 5);
  std::istringstream log(read_text_file(root + "/five.jsonl"));
  std::vector<int> epochs;
  for (std::string line; std::getline(log, line);) epochs.push_back(json::parse(line)["epoch"].get<int>());
  EXPECT_EQ(epochs, (std::vector<int>{1, 2, 3, 4, 5}));  // one step per epoch of 2 examples
  EXPECT_NE(five.err.find("5/5"), std::string::npos) << five.err;
  EXPECT_EQ(five.err.find("1/1"), std::string::npos) << "one bar over N steps, not one per epoch:\n" << five.err;
  CommandResult capped = run_meshtune(train + "--steps 5 --epochs 2 --no-progress --out " + root + "/capped");
  ASSERT_EQ(capped.exit_code, 0) << capped.err;
  EXPECT_EQ(json::parse(capped.out)["steps"], 2);
  std::filesystem::remove_all(root);
}

// A step whose loss, gradient or update is not finite stops the run (Keras' TerminateOnNaN): exit 1
// naming the step, no adapter written, and the last checkpoint is the last finite step's, from which
// the run resumes to a finite adapter. An absurd learning rate blows the adapter up: lr 1e20 makes
// step 2's loss NaN (caught before its update), lr 1e38 makes step 2's update overflow.
TEST(FinetuneCli, ANonFiniteStepStopsTheRunAndKeepsTheLastGoodCheckpoint) {
  const GemmaConfig config = read_model_config(inspect_model_dir(fixture("keras/preset-gemma-tiny")));
  for (const auto& [lr, says] : {std::pair<std::string, std::string>{"1e20", "stopped before this step's update"},
                                 {"1e38", "the update made"}}) {
    SCOPED_TRACE("--lr " + lr);
    const std::string root = make_temp_dir("ftnan");
    const std::string common = "finetune " + fixture("keras/preset-gemma-tiny") +
                               " --data sample --seq-len 16 --no-progress --checkpoint-every 1 --out " + root + "/run";
    const CommandResult blown = run_meshtune(common + " --steps 6 --lr " + lr);
    EXPECT_EQ(blown.exit_code, 1) << blown.err;
    const size_t at = blown.err.find("meshtune: error: step ");
    ASSERT_NE(at, std::string::npos) << blown.err;
    EXPECT_NE(blown.err.find(says, at), std::string::npos) << blown.err;
    const int failed_step = std::stoi(blown.err.substr(at + std::string("meshtune: error: step ").size()));
    EXPECT_GE(failed_step, 2);
    EXPECT_FALSE(fs::exists(root + "/run/adapter.lora.h5"));
    const CommandResult resumed = run_meshtune(common + " --steps " + std::to_string(failed_step - 1) + " --resume");
    ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
    EXPECT_NE(resumed.err.find("at step " + std::to_string(failed_step - 1)), std::string::npos) << resumed.err;
    for (const LoraAdapter& a : load_keras_lora(root + "/run/adapter.lora.h5", config).adapters)
      for (const std::vector<float>* values : {&a.a, &a.b})
        for (float v : *values) ASSERT_TRUE(std::isfinite(v));
    fs::remove_all(root);
  }
}

// One run per --out: while another process holds the directory's lock (a run in progress), a
// second finetune there is refused at once, before it loads anything or touches a file — with
// --resume and --overwrite too; once the lock is released (the holder ends, however it ends),
// the directory is free.
TEST(FinetuneCli, ASecondRunOnTheSameOutIsRefused) {
  const std::string root = make_temp_dir("ftlock");
  const std::string out = root + "/run";
  const std::string train = "finetune " + fixture("keras/preset-gemma-tiny") +
                            " --data sample --seq-len 16 --steps 1 --no-progress --out " + out;
  fs::create_directories(out);
  const int held = ::open((out + "/.meshtune.lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);
  for (const std::string& mode : {"", " --overwrite", " --resume"}) {
    const CommandResult refused = run_meshtune(train + mode);
    EXPECT_EQ(refused.exit_code, 1) << mode << refused.err;
    EXPECT_NE(refused.err.find("--out " + out + ": another process is using this run directory"), std::string::npos)
        << refused.err;
    EXPECT_EQ(refused.err.find("loaded"), std::string::npos) << "refused before loading:\n" << refused.err;
  }
  EXPECT_TRUE(run_outputs(out).empty());
  ::close(held);
  const CommandResult free = run_meshtune(train);
  EXPECT_EQ(free.exit_code, 0) << free.err;
  EXPECT_TRUE(fs::exists(out + "/adapter.lora.h5"));
  fs::remove_all(root);
}

// Prompt/response JSONL trains end to end (the loss on the responses only).
TEST(FinetuneCli, PromptResponseDataTrains) {
  const std::string root = make_temp_dir("ftpairs");
  ASSERT_EQ(run_meshtune("init --config tiny-gemma3 " + root + "/tiny").exit_code, 0);
  { std::ofstream(root + "/pairs.jsonl") << "{\"prompts\": \"Say hi\", \"responses\": \"hi\"}\n"
                                            "{\"prompt\": \"Is it good?\", \"response\": \"A great movie.\"}\n"; }
  CommandResult r = run_meshtune("finetune " + root + "/tiny --data " + root + "/pairs.jsonl --batch-size 2 --seq-len 16 "
                                 "--steps 3 --no-progress --out " + root + "/run");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const double loss = json::parse(r.out)["loss"].get<double>();
  EXPECT_TRUE(std::isfinite(loss) && loss > 0) << r.out;
  std::filesystem::remove_all(root);
}

TEST(FinetuneCli, BadArgumentsAreClearErrors) {
  const std::string root = make_temp_dir("ftbad");
  const std::string model = root + "/tiny";
  ASSERT_EQ(run_meshtune("init " + model).exit_code, 0);
  CommandResult zero = run_meshtune("finetune " + model + " --data sample --seq-len 0 --out " + root + "/o");
  EXPECT_EQ(zero.exit_code, 1);
  EXPECT_NE(zero.err.find("--seq-len"), std::string::npos) << zero.err;
  // An adapter made for another model does not fit (gemma-tiny's value A is (1, 64, 2); this
  // model has 2 KV heads).
  ASSERT_EQ(run_meshtune("init --config tiny-gemma2 " + root + "/tiny2").exit_code, 0);
  CommandResult bad = run_meshtune("finetune " + root + "/tiny2 --data sample --steps 1 --out " + root + "/o --lora-init " +
                                   fixture("keras/lora-gemma-tiny/adapter.lora.h5"));
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("adapter.lora.h5"), std::string::npos) << bad.err;
  std::string empty = root + "/empty.jsonl";
  { std::ofstream(empty) << "\n"; }
  CommandResult none = run_meshtune("finetune " + model + " --data " + empty + " --out " + root + "/o");
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.err.find("empty.jsonl"), std::string::npos) << none.err;
  // Values that used to be taken as "unset" or trained on (issue 21): one line naming the flag and
  // its range, nothing written.
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"finetune --lr nan", "--lr"}, {"finetune --lr -1", "--lr"}, {"finetune --weight-decay nan", "--weight-decay"},
      {"finetune --beta1 2", "--beta1"}, {"finetune --beta2 nan", "--beta2"}, {"finetune --epsilon -1", "--epsilon"},
      {"finetune --final-lr-fraction nan", "--final-lr-fraction"}, {"finetune --checkpoint-every -1", "--checkpoint-every"},
      {"finetune --clipnorm 0", "--clipnorm"}, {"finetune --clipvalue -1", "--clipvalue"},
      {"finetune --global-clipnorm nan", "--global-clipnorm"}, {"finetune --grad-accum 0", "--grad-accum"},
      {"finetune --lora-rank 0", "--lora-rank"}, {"finetune --lora-alpha inf", "--lora-alpha"},
      {"generate --prompt hi --max-length 0", "--max-length"}, {"generate --prompt hi --temperature inf", "--temperature"}};
  for (const auto& [command, flag] : refused) {
    const std::string verb = command.substr(0, command.find(' ')), flags = command.substr(command.find(' '));
    const CommandResult r = run_meshtune(verb + " " + model + (verb == "finetune" ? " --data sample --steps 1 --seq-len 8 --out " + root + "/refused" : "") + flags);
    EXPECT_EQ(r.exit_code, 1) << command << "\n" << r.err;
    EXPECT_NE(r.err.find("meshtune: error: "), std::string::npos) << command << "\n" << r.err;
    EXPECT_NE(r.err.find(flag), std::string::npos) << command << "\n" << r.err;
  }
  EXPECT_TRUE(run_outputs(root + "/refused").empty());
}

}  // namespace

namespace {

// Ctrl-C (SIGINT) saves a checkpoint and exits with 130; --resume then finishes the run.
TEST(Interrupt, SigintSavesAndExitsCleanly) {
  const std::string root = make_temp_dir("sigint");
  ASSERT_EQ(run_meshtune("init " + root + "/tiny").exit_code, 0);
  const std::string args = "finetune " + root + "/tiny --data sample --seq-len 16 --batch-size 4 --epochs 200 "
                           "--no-progress --out " + root + "/run";
  // Background the run, interrupt it once it has started training, and wait for it.
  const std::string script = root + "/interrupt.sh";
  std::ofstream(script) << "'" << MESHTUNE_BINARY << "' " << args << " >" << root << "/out 2>" << root << "/err &\n"
                        << "pid=$!\n"
                        << "for i in $(seq 100); do grep -q 'trainable params' " << root << "/err && break; sleep 0.1; done\n"
                        << "sleep 0.3\nkill -INT $pid\nwait $pid\necho $? >" << root << "/rc\n";
  ASSERT_EQ(std::system(("bash " + script).c_str()), 0);
  EXPECT_EQ(read_text_file(root + "/rc"), "130\n") << read_text_file(root + "/err");
  EXPECT_NE(read_text_file(root + "/err").find("interrupted: saved"), std::string::npos);
  EXPECT_TRUE(fs::exists(root + "/run/checkpoint.safetensors"));
  EXPECT_FALSE(fs::exists(root + "/run/adapter.lora.h5"));
}

// export --lora merges an adapter into a Keras preset or an HF checkpoint that give the same logits
// as generating with the adapter.
TEST(Export, MergedAdapterExportsMatchTheAdapter) {
  const std::string root = make_temp_dir("export");
  const std::string model = fixture("keras/preset-gemma-tiny");
  const std::string adapter = fixture("keras/lora-gemma-tiny/adapter.lora.h5");
  const std::string ids = fixture("keras/outputs-gemma-tiny/token_ids.npy");
  ASSERT_EQ(run_meshtune("export " + model + " --lora " + adapter + " --to keras " + root + "/k").exit_code, 0);
  ASSERT_EQ(run_meshtune("export " + model + " --lora " + adapter + " --to hf " + root + "/h").exit_code, 0);
  ASSERT_EQ(run_meshtune("logits " + model + " --lora " + adapter + " --token-ids " + ids + " --out " + root + "/a.npy").exit_code, 0);
  ASSERT_EQ(run_meshtune("logits " + root + "/k --token-ids " + ids + " --out " + root + "/b.npy").exit_code, 0);
  ASSERT_EQ(run_meshtune("logits " + root + "/h --token-ids " + ids + " --out " + root + "/c.npy").exit_code, 0);
  EXPECT_EQ(read_text_file(root + "/a.npy"), read_text_file(root + "/b.npy"));
  EXPECT_EQ(read_text_file(root + "/a.npy"), read_text_file(root + "/c.npy"));
  // Keras' own merged checkpoint (model_with_lora.weights.h5) equals our merged Keras weights.
  auto ours = read_h5_datasets(root + "/k/model.weights.h5");
  auto keras = read_h5_datasets(fixture("keras/lora-gemma-tiny/model_with_lora.weights.h5"));
  for (const auto& [name, t] : ours) {
    auto it = keras.find(name);
    ASSERT_NE(it, keras.end()) << name;
    EXPECT_EQ(to_f32(t), to_f32(it->second)) << name;
  }
}

}  // namespace

// Conversations whose answers the sequence length cuts off entirely train on nothing: refused when
// no example keeps a trained token (naming --seq-len), a warning with the count when some do.
// (Prompt/response pairs cannot: Keras' packer truncates prompt and response in turn.)
TEST(FinetuneCli, AnswersCutOffBySeqLenAreRefusedOrCounted) {
  const std::string root = make_temp_dir("ftcut");
  auto chat = [](const std::string& question, const std::string& answer) {
    return "{\"messages\": [{\"role\": \"user\", \"content\": \"" + question +
           "\"}, {\"role\": \"model\", \"content\": \"" + answer + "\"}]}\n";
  };
  const std::string long_question = "Tell me at great length what you thought of the acting, the story, the music and the ending";
  { std::ofstream(root + "/chat.jsonl") << chat(long_question, "Yes.") << chat(long_question + " twice", "Good."); }
  const std::string base = "finetune " + fixture("keras/preset-gemma-tiny") + " --seq-len 16 --steps 1 --no-progress";
  const CommandResult none = run_meshtune(base + " --data " + root + "/chat.jsonl --out " + root + "/run-none");
  EXPECT_EQ(none.exit_code, 1) << none.err;
  EXPECT_NE(none.err.find("no example keeps a token to train on: at sequence_length (--seq-len) 16 every prompt fills "
                          "all 16 positions"), std::string::npos) << none.err;
  EXPECT_FALSE(fs::exists(root + "/run-none/adapter.lora.h5"));
  { std::ofstream(root + "/chat.jsonl", std::ios::app) << chat("Hi", "Hello there."); }
  const CommandResult some = run_meshtune(base + " --data " + root + "/chat.jsonl --out " + root + "/run-some");
  EXPECT_EQ(some.exit_code, 0) << some.err;
  EXPECT_NE(some.err.find("warning: 2 of 3 examples keep no token to train on at sequence_length (--seq-len) 16"),
            std::string::npos) << some.err;
  fs::remove_all(root);
}

// A batch the machine cannot hold is refused before training starts, with the flags that size it
// and the estimate (the memory limit here: ulimit -v); info prints the same estimate.
TEST(FinetuneCli, ARunTooBigForTheMachineIsRefusedAtOnce) {
  const std::string root = make_temp_dir("ftbig");
  const std::string tiny = fixture("keras/preset-gemma-tiny");
  const CommandResult big = run_meshtune("finetune " + tiny + " --data sample --batch-size 4096 --seq-len 8192 --no-progress --out " +
                                         root + "/run");
  EXPECT_EQ(big.exit_code, 1) << big.err;
  EXPECT_NE(big.err.find("fit: batch 4096 × sequence_length 8192 (--batch-size, --seq-len) needs about"), std::string::npos)
      << big.err;
  EXPECT_NE(big.err.find("lower --batch-size or --seq-len"), std::string::npos) << big.err;
  EXPECT_FALSE(fs::exists(root + "/run/adapter.lora.h5"));
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MESHTUNE_TEST_ASAN 1
#endif
#endif
#if !defined(__SANITIZE_ADDRESS__) && !defined(MESHTUNE_TEST_ASAN)
  // (AddressSanitizer reserves terabytes of address space, so ulimit -v is for the plain build only.)
  const CommandResult limited = run_meshtune("finetune " + tiny + " --data sample --batch-size 128 --seq-len 2048 --no-progress --out " +
                                             root + "/run2", "", "ulimit -v 2000000; ");
  EXPECT_EQ(limited.exit_code, 1) << limited.err;
  EXPECT_NE(limited.err.find("but ulimit -v allows 1.91 GiB"), std::string::npos) << limited.err;
#endif
  const CommandResult info = run_meshtune("info " + tiny + " --lora-rank 4 --batch-size 4096 --seq-len 8192");
  EXPECT_EQ(info.exit_code, 0) << info.err;
  EXPECT_NE(info.out.find("Training memory (one process, batch 4096 × sequence_length 8192, LoRA rank 4, float32): about"),
            std::string::npos) << info.out;
  fs::remove_all(root);
}
