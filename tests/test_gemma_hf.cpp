// Hugging Face checkpoints against llama.cpp's logits (an independent implementation), and the
// same weights as a Keras preset and as an HF checkpoint giving identical logits.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "generate/generate.h"
#include "store/load.h"
#include "store/save.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;
using json = nlohmann::json;

namespace {

std::vector<float> read_f32_file(const std::string& path) {
  std::string bytes = read_text_file(path);
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

std::vector<float> score(const GemmaModel& model, const std::vector<int32_t>& ids) {
  const int64_t T = int64_t(ids.size());
  KVCache cache(model.config, 1, T, meshtune::testing::cpu_backend());
  const FloatBuffer hidden = backbone_forward(meshtune::testing::cpu_context(), model, ids.data(), 1, T, 0, cache);
  std::vector<float> logits(size_t(T * model.config.vocab_size));
  lm_head(meshtune::testing::cpu_context(), model, hidden, T, logits);
  return logits;
}

int argmax(const float* x, int n) { return int(std::max_element(x, x + n) - x); }

class HfFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(HfFixture, LogitsMatchLlamaCpp) {
  const std::string dir = fixture("hf/" + GetParam()) + "/";
  json index = json::parse(read_text_file(dir + "index.json"));
  GemmaModel model = load_model(inspect_model_dir(dir + "checkpoint"));
  const int V = model.config.vocab_size;
  for (const auto& seq : index["sequences"]) {
    auto ids = seq["tokens"].get<std::vector<int32_t>>();
    std::vector<float> got = score(model, ids), expected = read_f32_file(dir + seq["file"].get<std::string>());
    ASSERT_EQ(got.size(), expected.size());
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, double(std::fabs(got[i] - expected[i])));
    EXPECT_LT(worst, 2e-3) << seq["file"];
    for (size_t t = 0; t < ids.size(); ++t)
      EXPECT_EQ(argmax(&got[t * V], V), seq["argmax"][t].get<int>()) << seq["file"] << " position " << t;
  }
}

TEST_P(HfFixture, GreedyTokensAndStepLogitsMatchLlamaCpp) {
  const std::string dir = fixture("hf/" + GetParam()) + "/";
  json gen = json::parse(read_text_file(dir + "index.json"))["gen"];
  GemmaModel model = load_model(inspect_model_dir(dir + "checkpoint"));
  auto prompt = gen["prompt"].get<std::vector<int32_t>>();
  auto expected = gen["tokens"].get<std::vector<int32_t>>();
  const int L = int(prompt.size() + expected.size());
  std::vector<int32_t> row(size_t(L), 0);
  std::vector<uint8_t> mask(size_t(L), 0);
  for (size_t i = 0; i < prompt.size(); ++i) { row[i] = prompt[i]; mask[i] = 1; }
  GenerateOptions options;
  options.max_length = L;  // no stop on EOS, as llama.cpp ran
  GeneratedIds got = generate_ids(meshtune::testing::cpu_context(), model, {row}, {mask}, options);
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(got.token_ids[0][prompt.size() + i], expected[i]) << i;

  // The logits of each step (through the cache) against llama.cpp's, via a full rescoring.
  std::vector<float> step_logits = read_f32_file(dir + gen["file"].get<std::string>());
  std::vector<float> full = score(model, got.token_ids[0]);
  const int V = model.config.vocab_size;
  double worst = 0;
  for (size_t i = 0; i < expected.size(); ++i)
    for (int v = 0; v < V; ++v)
      worst = std::max(worst, double(std::fabs(full[(prompt.size() - 1 + i) * V + v] - step_logits[i * V + v])));
  EXPECT_LT(worst, 2e-3);
}

INSTANTIATE_TEST_SUITE_P(Hf, HfFixture, ::testing::Values("tiny-gemma", "tiny-gemma2-capped"),
                         [](const auto& info) { return info.index == 0 ? std::string("Gemma1") : std::string("Gemma2Capped"); });

// Keras preset -> HF checkpoint -> Keras preset: logits bit-identical at every step.
TEST(FormatEquivalence, KerasAndHfGiveIdenticalLogits) {
  for (std::string name : {"gemma-tiny", "gemma2-tiny"}) {
    ModelDir keras_dir = inspect_model_dir(fixture("keras/preset-" + name));
    GemmaModel keras_model = load_model(keras_dir);
    const std::string hf_dir = make_temp_dir("hf-" + name), back_dir = make_temp_dir("keras-" + name);
    save_hf_checkpoint(keras_model, keras_dir.tokenizer_path, hf_dir);
    ModelDir hf = inspect_model_dir(hf_dir);
    EXPECT_EQ(hf.format, ModelFormat::HuggingFace);
    GemmaModel hf_model = load_model(hf);
    save_keras_preset(hf_model, hf.tokenizer_path, 12, back_dir);
    GemmaModel back_model = load_model(inspect_model_dir(back_dir));

    std::vector<int32_t> ids = {2, 549, 323, 268, 291, 628, 328, 367, 341, 691, 272, 265};
    std::vector<float> a = score(keras_model, ids), b = score(hf_model, ids), c = score(back_model, ids);
    EXPECT_EQ(a, b) << name;
    EXPECT_EQ(a, c) << name;
    EXPECT_EQ(hf_model.config.num_parameters(), keras_model.config.num_parameters());
    EXPECT_EQ(back_model.config.to_keras_json()["config"].dump(), keras_model.config.to_keras_json()["config"].dump());
  }
}

}  // namespace
