// The forward pass and generate() against real Keras/KerasHub output (../shared/fixtures/keras).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cpu_path_test.h"
#include "core/error.h"
#include "io/npy.h"
#include "generate/generate.h"
#include "store/load.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;
using json = nlohmann::json;

namespace {

struct KerasCase {
  std::string preset, outputs, summary;
};

class KerasFixture : public ::testing::TestWithParam<KerasCase> {};

// The forward on every CPU path this machine has (each path's kernels against Keras' numbers).
class KerasFixtureOnEveryPath : public ::testing::TestWithParam<std::tuple<KerasCase, CpuPath>> {};

TEST_P(KerasFixtureOnEveryPath, EveryRecordedArrayWithin1e4) {
  const auto& [c, path] = GetParam();
  if (!cpu_supports(path)) GTEST_SKIP() << "this CPU has no " << cpu_path_name(path) << " path";
  const std::unique_ptr<CpuBackend> backend = meshtune::testing::cpu_backend_on(path);
  const Context ctx{*backend, MatmulPrecision::F32};
  const std::string out = fixture(c.outputs) + "/";
  GemmaModel model = load_model(inspect_model_dir(fixture(c.preset)));
  HostTensor ids_t = read_npy(out + "token_ids.npy");
  const int64_t B = ids_t.shape[0], T = ids_t.shape[1], D = model.config.hidden_dim, V = model.config.vocab_size;
  std::vector<int32_t> ids = npy_ints(out + "token_ids.npy"), mask = npy_ints(out + "padding_mask.npy");

  KVCache cache(model.config, B, T, ctx.backend);
  cache.set_key_valid(ctx.backend, std::vector<uint8_t>(mask.begin(), mask.end()));
  ForwardTrace trace;
  const std::vector<float> hidden =
      meshtune::testing::to_host(backbone_forward(ctx, model, ids.data(), B, T, 0, cache, &trace));
  std::vector<float> logits(size_t(B * T * V));
  lm_head(ctx, model, hidden, B * T, logits);

  EXPECT_LT(max_diff_valid(trace.embedding_lookup, npy_floats(out + "embedding_lookup.npy"), mask, D), 1e-4);
  EXPECT_LT(max_diff_valid(trace.embedding_scaled, npy_floats(out + "embedding_scaled.npy"), mask, D), 1e-4);
  for (int i = 0; i < model.config.num_layers; ++i)
    EXPECT_LT(max_diff_valid(trace.block_outputs[i], npy_floats(out + "block_" + std::to_string(i) + "_output.npy"),
                             mask, D),
              1e-4)
        << "block " << i;
  EXPECT_LT(max_diff_valid(hidden, npy_floats(out + "hidden_states.npy"), mask, D), 1e-4);
  EXPECT_LT(max_diff_valid(logits, npy_floats(out + "logits.npy"), mask, V), 1e-4);
  if (model.config.final_logit_soft_cap > 0) {
    std::vector<float> raw(logits.size());
    backend->linear(hidden, B * T, model.embeddings, raw, MatmulPrecision::F32);
    EXPECT_LT(max_diff_valid(raw, npy_floats(out + "logits_before_soft_cap.npy"), mask, V), 1e-4);
  }
}

// A cache of one pass (training, scoring) keeps no keys: each block's attention reads the pass' own.
// The same numbers, bit for bit, as through a cache that keeps them; and it serves only a pass that
// fills it.
TEST_P(KerasFixture, OnePassCacheEqualsAKeptOne) {
  const KerasCase& c = GetParam();
  const std::string out = fixture(c.outputs) + "/";
  const GemmaModel model = load_model(inspect_model_dir(fixture(c.preset)));
  const Context ctx = meshtune::testing::cpu_context();
  const std::vector<int32_t> ids = npy_ints(out + "token_ids.npy"), mask = npy_ints(out + "padding_mask.npy");
  const int64_t B = read_npy(out + "token_ids.npy").shape[0], T = int64_t(ids.size()) / B;
  const auto hidden = [&](KVCache& cache) {
    cache.set_key_valid(ctx.backend, std::vector<uint8_t>(mask.begin(), mask.end()));
    return meshtune::testing::to_host(backbone_forward(ctx, model, ids.data(), B, T, 0, cache));
  };
  KVCache kept(model.config, B, T, ctx.backend), one_pass(model.config, B, T, ctx.backend, /*keep_keys=*/false);
  EXPECT_TRUE(kept.keeps_keys());
  EXPECT_FALSE(one_pass.keeps_keys());
  EXPECT_EQ(hidden(one_pass), hidden(kept));
  KVCache longer(model.config, B, T + 1, ctx.backend, /*keep_keys=*/false);
  EXPECT_THROW(backbone_forward(ctx, model, ids.data(), B, T, 0, longer), Error);
  EXPECT_THROW(backbone_forward(ctx, model, ids.data(), B, T - 1, 1, longer), Error);
}

TEST_P(KerasFixture, GreedyIdsEqualKeras) {
  const KerasCase& c = GetParam();
  const std::string out = fixture(c.outputs) + "/";
  GemmaModel model = load_model(inspect_model_dir(fixture(c.preset)));
  const PromptRows prompts = read_prompt_rows(out + "generate_prompt_token_ids.npy", out + "generate_prompt_padding_mask.npy");
  const int64_t B = prompts.batch, L = prompts.length;
  std::vector<int32_t> expected = npy_ints(out + "generate_greedy_token_ids.npy");
  std::vector<int32_t> expected_mask = npy_ints(out + "generate_greedy_padding_mask.npy");
  GenerateOptions options;
  options.max_length = int(L);  // the fixture's generate(ids, stop_token_ids=None)
  GeneratedIds got = generate_ids(meshtune::testing::cpu_context(), model, prompts.rows, prompts.masks, options);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < L; ++i) {
      EXPECT_EQ(got.token_ids[b][i], expected[b * L + i]) << "row " << b << " position " << i;
      EXPECT_EQ(int(got.padding_mask[b][i]), expected_mask[b * L + i]) << "row " << b << " position " << i;
    }
}

TEST_P(KerasFixture, StringGenerationEqualsKeras) {
  const KerasCase& c = GetParam();
  json summary = json::parse(read_text_file(fixture(c.summary)));
  const json& g = summary["generate_strings"];
  ModelDir dir = inspect_model_dir(fixture(c.preset));
  GemmaModel model = load_model(dir);
  Tokenizer tokenizer(dir.tokenizer_path);
  GenerateOptions options;
  options.max_length = g["max_length"].get<int>();
  options.stop_token_ids = default_stop_token_ids(model, tokenizer);  // "auto": <eos>
  auto prompts = g["prompts"].get<std::vector<std::string>>();
  auto results = generate_text(meshtune::testing::cpu_context(), model, tokenizer, prompts, options);
  auto expected = g["outputs"].get<std::vector<std::string>>();
  ASSERT_EQ(results.size(), expected.size());
  for (size_t i = 0; i < results.size(); ++i) {
    EXPECT_EQ(results[i].text, expected[i]);
    // The preprocessed prompt ids are the start of our ids.
    auto pre = g["generate_preprocess_token_ids"][i].get<std::vector<int>>();
    auto pre_mask = g["generate_preprocess_padding_mask"][i].get<std::vector<int>>();
    for (size_t j = 0; j < pre.size(); ++j) {
      if (pre_mask[j]) {
        EXPECT_EQ(results[i].token_ids[j], pre[j]);
      }
    }
  }
}

const auto kKerasCases = ::testing::Values(
    KerasCase{"keras/preset-gemma-tiny", "keras/outputs-gemma-tiny", "keras/summary-gemma-tiny.json"},
    KerasCase{"keras/preset-gemma2-tiny", "keras/outputs-gemma2-tiny", "keras/summary-gemma2-tiny.json"});
std::string family_name(const KerasCase& c) {
  return c.preset == "keras/preset-gemma-tiny" ? "Gemma1" : "Gemma2";
}

INSTANTIATE_TEST_SUITE_P(Keras, KerasFixture, kKerasCases,
                         [](const auto& info) { return family_name(info.param); });
INSTANTIATE_TEST_SUITE_P(Keras, KerasFixtureOnEveryPath, ::testing::Combine(kKerasCases, kEveryCpuPath),
                         [](const auto& info) {
                           return family_name(std::get<0>(info.param)) + "_" + cpu_path_name(std::get<1>(info.param));
                         });

TEST(KerasSummary, VariablePathsShapesAndCountMatch) {
  for (std::string name : {"gemma-tiny", "gemma2-tiny"}) {
    json summary = json::parse(read_text_file(fixture("keras/summary-" + name + ".json")));
    GemmaModel model = load_model(inspect_model_dir(fixture("keras/preset-" + name)));
    EXPECT_EQ(model.config.num_parameters(), summary["num_params"].get<long long>()) << name;
  }
}

}  // namespace
