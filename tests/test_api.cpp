// The library API (api/causal_lm.h) against the Keras fixtures and against the command line: the
// tutorial's verbs — from_preset, variables and summary, enable_lora, load_lora_weights, generate,
// compile + fit with callbacks, evaluate, save — and its errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>

#include "api/causal_lm.h"
#include "core/error.h"
#include "io/npy.h"
#include "store/lora_files.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kTiny = fixture("keras/preset-gemma-tiny");
const std::string kLoraDir = "keras/lora-gemma-tiny/";

std::string quote(const std::string& s) { return "'" + s + "'"; }

api::PresetOptions quiet() {
  static std::ostringstream sink;  // the loading notes, out of the test log
  api::PresetOptions o;
  o.notes = &sink;
  return o;
}

api::GemmaCausalLM tiny() { return api::GemmaCausalLM::from_preset(kTiny, quiet()); }

// The tutorial's fit on the built-in sample reviews, as `finetune --steps N` runs it.
api::FitRunOptions steps(int64_t n) {
  api::FitRunOptions run;
  run.epochs = 0;
  run.steps = n;
  run.batch_size = 2;
  run.sequence_length = 32;
  return run;
}

// Records Keras' on_train_batch_end logs and stops the run after `stop_after` steps.
class Recorder : public api::Callback {
 public:
  Recorder(api::GemmaCausalLM* model, int64_t stop_after) : model_(model), stop_after_(stop_after) {}
  void step_end(const StepReport& r) override {
    losses.push_back(r.loss);
    if (model_ && r.step == stop_after_) model_->stop_training();
  }
  std::vector<double> losses;

 private:
  api::GemmaCausalLM* model_;
  int64_t stop_after_;
};

// Keras' generate_strings (max_length 10) of the fixture's prompts, by `lm`.
void expect_keras_strings(const api::GemmaCausalLM& lm) {
  const json summary = json::parse(read_text_file(fixture("keras/summary-gemma-tiny.json")));
  std::vector<std::string> prompts;
  for (const auto& p : summary["generate_strings"]["prompts"]) prompts.push_back(p);
  GenerateOptions options = lm.default_generate_options();
  options.max_length = 10;
  const std::vector<GeneratedText> out = lm.generate(prompts, options);
  ASSERT_EQ(out.size(), prompts.size());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i].text, summary["generate_strings"]["outputs"][i]) << i;
}

TEST(Api, GenerateGivesKerasStrings) { expect_keras_strings(tiny()); }

TEST(Api, VariablesAfterEnableLoraAreKerasOnes) {
  api::GemmaCausalLM lm = tiny();
  lm.enable_lora({2, {"query", "value"}, 0, 0});
  const json info = load_json(fixture(kLoraDir + "lora_info.json"));
  const std::vector<api::VariableInfo> vars = lm.variables();
  std::map<std::string, const api::VariableInfo*> by_path;
  for (const api::VariableInfo& v : vars) by_path[v.path] = &v;
  size_t checked = 0;
  for (const auto& v : info["variables_after_enable_lora"]) {
    const std::string path = v["path"];
    if (!by_path.count(path)) continue;
    const api::VariableInfo& ours = *by_path[path];
    EXPECT_EQ(ours.shape, v["shape"].get<Shape>()) << path;
    EXPECT_EQ(ours.trainable, v["trainable"].get<bool>()) << path;
    ++checked;
  }
  EXPECT_GT(checked, 10u);
  const api::ParameterSummary s = lm.summary();
  EXPECT_EQ(s.total, s.trainable + s.non_trainable);
  EXPECT_EQ(s.trainable, info["trainable_params_after_enable_lora"].get<long long>());
  EXPECT_EQ(s.non_trainable, info["non_trainable_params_after_enable_lora"].get<long long>());
}

TEST(Api, LoadLoraWeightsGivesKerasLogits) {
  api::GemmaCausalLM lm = tiny();
  lm.load_lora_weights(fixture(kLoraDir + "adapter.lora.h5"));
  const std::vector<int32_t> ids = npy_ints(fixture("keras/outputs-gemma-tiny/token_ids.npy"));
  const std::vector<int32_t> mask = npy_ints(fixture("keras/outputs-gemma-tiny/padding_mask.npy"));
  const int64_t B = 3, T = int64_t(ids.size()) / 3;
  std::vector<float> hidden, logits(size_t(B * T) * size_t(lm.config().vocab_size));
  lm.logits(ids, mask, B, T, &hidden, logits.data());
  const double dl = max_diff_valid(logits, npy_floats(fixture(kLoraDir + "logits_with_random_lora.npy")), mask,
                                   size_t(lm.config().vocab_size));
  const double dh = max_diff_valid(hidden, npy_floats(fixture(kLoraDir + "hidden_states_with_random_lora.npy")), mask,
                                   size_t(lm.config().hidden_dim));
  EXPECT_LT(dl, 1e-4);
  EXPECT_LT(dh, 1e-4);
}

// The whole model on ReferenceBackend — every op a plain loop — gives Keras' logits and hidden
// states within the fixture's tolerance and its greedy strings, and a LoRA fit on it follows the
// CPU backend's losses and adapter: model and train code reach values only through the backend.
TEST(Api, ReferenceBackendRunsTheModelAsKerasDoes) {
  api::PresetOptions options = quiet();
  options.backend = "reference";
  api::GemmaCausalLM lm = api::GemmaCausalLM::from_preset(kTiny, options);
  const std::string out = "keras/outputs-gemma-tiny/";
  const std::vector<int32_t> ids = npy_ints(fixture(out + "token_ids.npy"));
  const std::vector<int32_t> mask = npy_ints(fixture(out + "padding_mask.npy"));
  const int64_t B = 3, T = int64_t(ids.size()) / 3, V = lm.config().vocab_size;
  std::vector<float> hidden, logits(size_t(B * T * V));
  lm.logits(ids, mask, B, T, &hidden, logits.data());
  EXPECT_LT(max_diff_valid(logits, npy_floats(fixture(out + "logits.npy")), mask, size_t(V)), 1e-4);
  EXPECT_LT(max_diff_valid(hidden, npy_floats(fixture(out + "hidden_states.npy")), mask,
                           size_t(lm.config().hidden_dim)), 1e-4);
  expect_keras_strings(lm);

  api::GemmaCausalLM cpu = tiny();
  for (api::GemmaCausalLM* m : {&lm, &cpu}) {
    m->enable_lora();
    m->compile({});
  }
  Recorder on_reference(nullptr, 0), on_cpu(nullptr, 0);
  lm.fit(load_dataset("sample"), steps(2), {&on_reference});
  cpu.fit(load_dataset("sample"), steps(2), {&on_cpu});
  ASSERT_EQ(on_reference.losses.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_NEAR(on_reference.losses[i], on_cpu.losses[i], 1e-5) << "step " << i;
  const LoraWeights &a = *lm.lora(), &b = *cpu.lora();
  double worst = 0;
  for (size_t i = 0; i < a.adapters.size(); ++i)
    for (size_t j = 0; j < a.adapters[i].b.size(); ++j)
      worst = std::max(worst, double(std::abs(a.adapters[i].b[j] - b.adapters[i].b[j])));
  EXPECT_GT(worst, 0.0);   // the two backends round differently …
  EXPECT_LT(worst, 1e-6);  // … by far less than one AdamW step (lr 5e-5)
}

// Every verb of the API on a backend whose memory is tagged as a GPU's (the reference loops on
// host memory, so the numbers must equal the host reference bit for bit): what a CUDA backend runs
// through, checkpoints and a resumed run included, checked without a GPU.
TEST(Api, DeviceMemoryRunsEveryVerbAsTheHost) {
  const std::string dir = make_temp_dir("api-device-memory");
  const Dataset data = load_dataset("sample");
  auto load = [](const std::string& backend) {
    api::PresetOptions options = quiet();
    options.backend = backend;
    return api::GemmaCausalLM::from_preset(kTiny, options);
  };
  api::GemmaCausalLM host = load("reference"), device = load("reference-device");
  auto generated = [](const api::GemmaCausalLM& lm) {
    return lm.generate({"The"}, lm.default_generate_options()).at(0).token_ids;
  };
  EXPECT_EQ(generated(device), generated(host));
  std::map<std::string, Recorder> recorded = {{"host", {nullptr, 0}}, {"device", {nullptr, 0}}};
  for (auto [name, lm] : {std::pair{"host", &host}, std::pair{"device", &device}}) {
    lm->enable_lora();
    lm->compile({});
    api::FitRunOptions run = steps(3);
    run.checkpoint_path = dir + "/" + name + ".checkpoint.safetensors";
    run.checkpoint_every = 2;
    lm->fit(data, run, {&recorded.at(name)});
    lm->save_lora_weights(dir + "/" + name + ".lora.h5");
    lm->export_model("hf", dir + "/" + name + "-hf");
  }
  ASSERT_EQ(recorded.at("device").losses.size(), 3u);
  EXPECT_EQ(recorded.at("device").losses, recorded.at("host").losses);
  const LoraWeights a = load_keras_lora(dir + "/device.lora.h5", host.config());
  const LoraWeights b = load_keras_lora(dir + "/host.lora.h5", host.config());
  for (size_t i = 0; i < a.adapters.size(); ++i) EXPECT_EQ(a.adapters[i].b, b.adapters[i].b) << i;
  // After fit a device computes with the adapter as low-rank terms (merging reads the weights on the
  // host), the host with W + BA merged: equal up to rounding.
  const double device_loss = device.evaluate(data, steps(1)).loss;
  EXPECT_NEAR(device_loss, host.evaluate(data, steps(1)).loss, 1e-5);
  EXPECT_EQ(generated(device), generated(host));
  const api::GemmaCausalLM exported = api::GemmaCausalLM::from_preset(dir + "/device-hf", quiet());
  EXPECT_NEAR(exported.evaluate(data, steps(1)).loss, device_loss, 1e-5);  // merged, on the CPU backend

  // A run resumed from the device's checkpoint continues as the host's does.
  std::map<std::string, Recorder> resumed = {{"host", {nullptr, 0}}, {"device", {nullptr, 0}}};
  for (const std::string name : {"host", "device"}) {
    api::GemmaCausalLM lm = load(name == "host" ? "reference" : "reference-device");
    lm.enable_lora();
    lm.compile({});
    api::FitRunOptions run = steps(4);
    run.checkpoint_path = dir + "/" + name + ".checkpoint.safetensors";
    run.resume = true;
    const api::History h = lm.fit(data, run, {&resumed.at(name)});
    EXPECT_EQ(h.steps, 4) << name;
  }
  ASSERT_EQ(resumed.at("device").losses.size(), 1u);
  EXPECT_EQ(resumed.at("device").losses, resumed.at("host").losses);

  // Full fine-tuning: the working copies live on the device; saving downloads them.
  std::map<std::string, Recorder> full = {{"host", {nullptr, 0}}, {"device", {nullptr, 0}}};
  for (const std::string name : {"host", "device"}) {
    api::GemmaCausalLM lm = load(name == "host" ? "reference" : "reference-device");
    lm.compile({});
    lm.set_sequence_length(32);
    lm.fit(data, steps(2), {&full.at(name)});
    EXPECT_FALSE(lm.generate({"The"}, lm.default_generate_options()).at(0).token_ids.empty()) << name;
    lm.save_to_preset(dir + "/" + name + "-full");
  }
  EXPECT_EQ(full.at("device").losses, full.at("host").losses);
  EXPECT_EQ(api::GemmaCausalLM::from_preset(dir + "/device-full", quiet()).evaluate(data, steps(1)).loss,
            api::GemmaCausalLM::from_preset(dir + "/host-full", quiet()).evaluate(data, steps(1)).loss);
}

TEST(Api, FitEqualsTheCommandLine) {
  const std::string dir = make_temp_dir("api-fit-cli");
  const CommandResult cli = run_meshtune("finetune " + quote(kTiny) +
                                         " --data sample --steps 3 --seq-len 32 --no-progress --out " + quote(dir));
  ASSERT_EQ(cli.exit_code, 0) << cli.err;
  const json result = json::parse(cli.out.substr(cli.out.rfind('{')));

  api::GemmaCausalLM lm = tiny();
  lm.enable_lora();
  lm.compile({});
  const api::History h = lm.fit(load_dataset("sample"), steps(3));
  EXPECT_EQ(h.steps, 3);
  EXPECT_FALSE(h.interrupted);
  ASSERT_EQ(h.loss.size(), 1u);
  EXPECT_EQ(h.loss.back(), result["loss"].get<double>());
  EXPECT_EQ(h.accuracy.back(), result["accuracy"].get<double>());
  EXPECT_EQ(h.trainable_params, result["trainable_params"].get<long long>());
  // The adapter written through the API is the CLI's, value for value.
  lm.save_lora_weights(dir + "/api.lora.h5");
  const LoraWeights ours = load_keras_lora(dir + "/api.lora.h5", lm.config());
  const LoraWeights cli_adapter = load_keras_lora(dir + "/adapter.lora.h5", lm.config());
  ASSERT_EQ(ours.adapters.size(), cli_adapter.adapters.size());
  for (size_t i = 0; i < ours.adapters.size(); ++i) {
    EXPECT_EQ(ours.adapters[i].a, cli_adapter.adapters[i].a) << i;
    EXPECT_EQ(ours.adapters[i].b, cli_adapter.adapters[i].b) << i;
  }
}

TEST(Api, ACallbackStopsTrainingAndASecondFitContinues) {
  const Dataset data = load_dataset("sample");
  api::GemmaCausalLM straight = tiny();
  straight.enable_lora();
  straight.compile({});
  Recorder all(nullptr, 0);
  straight.fit(data, steps(4), {&all});
  ASSERT_EQ(all.losses.size(), 4u);

  api::GemmaCausalLM stopped = tiny();
  stopped.enable_lora();
  stopped.compile({});
  Recorder first(&stopped, 2);
  const api::History h = stopped.fit(data, steps(4), {&first});
  EXPECT_TRUE(h.interrupted);
  EXPECT_EQ(h.steps, 2);
  // A later fit trains `steps` more from where the first stopped, with the same optimizer state:
  // the same steps as one run of 4.
  Recorder second(nullptr, 0);
  const api::History h2 = stopped.fit(data, steps(2), {&second});
  EXPECT_EQ(h2.steps, 4);
  EXPECT_FALSE(h2.interrupted);
  std::vector<double> joined = first.losses;
  joined.insert(joined.end(), second.losses.begin(), second.losses.end());
  EXPECT_EQ(joined, all.losses);
  // After training, generate and evaluate use the trained adapter; evaluate changes nothing.
  const EpochMetrics e1 = stopped.evaluate(data, steps(1)), e2 = stopped.evaluate(data, steps(1));
  EXPECT_EQ(e1.loss, e2.loss);
  EXPECT_TRUE(std::isfinite(e1.loss));
  EXPECT_FALSE(stopped.generate({"The"}, stopped.default_generate_options()).empty());
}

TEST(Api, FullFineTuningSavesAPresetThatLoads) {
  const std::string dir = make_temp_dir("api-full");
  api::GemmaCausalLM lm = tiny();
  lm.compile({});
  lm.set_sequence_length(32);
  const api::History h = lm.fit(load_dataset("sample"), steps(2));
  EXPECT_EQ(h.trainable_params, lm.config().num_parameters());
  lm.save_to_preset(dir + "/model");
  const api::GemmaCausalLM again = api::GemmaCausalLM::from_preset(dir + "/model", quiet());
  EXPECT_EQ(again.sequence_length(), 32);
  // The saved weights are the trained ones: the same loss on the same data.
  EXPECT_EQ(again.evaluate(load_dataset("sample"), steps(1)).loss, lm.evaluate(load_dataset("sample"), steps(1)).loss);
}

TEST(Api, ErrorsAreExceptionsNamingTheRule) {
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  api::PresetOptions bad = quiet();
  bad.dtype_policy = "float16";
  EXPECT_NE(message([&] { api::GemmaCausalLM::from_preset(kTiny, bad); }).find("mixed_bfloat16"), std::string::npos);
  EXPECT_NE(message([&] { api::GemmaCausalLM::from_preset("/nonexistent/model", quiet()); }).find("/nonexistent/model"),
            std::string::npos);
  api::GemmaCausalLM lm = tiny();
  EXPECT_NE(message([&] { lm.enable_lora({0}); }).find("rank"), std::string::npos);
  EXPECT_NE(message([&] { lm.fit(load_dataset("sample"), steps(1)); }).find("compile"), std::string::npos);
  api::CompileOptions nan_lr;
  nan_lr.learning_rate = std::nan("");
  EXPECT_NE(message([&] { lm.compile(nan_lr); }).find("--lr"), std::string::npos);
  api::CompileOptions beta;
  beta.beta_1 = 1;
  EXPECT_NE(message([&] { lm.compile(beta); }).find("[0, 1)"), std::string::npos);
  EXPECT_NE(message([&] { lm.set_sequence_length(0); }).find("--seq-len"), std::string::npos);
  EXPECT_NE(message([&] { lm.save_lora_weights("/tmp/x.lora.h5"); }).find("enable_lora"), std::string::npos);
  lm.enable_lora();
  lm.compile({});
  lm.fit(load_dataset("sample"), steps(1));
  EXPECT_NE(message([&] { lm.enable_lora(); }).find("before the first fit"), std::string::npos);
  GenerateOptions zero = lm.default_generate_options();
  zero.max_length = 0;
  EXPECT_NE(message([&] { lm.generate({"x"}, zero); }).find("max_length"), std::string::npos);
}

}  // namespace
