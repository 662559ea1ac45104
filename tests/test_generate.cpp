// generate(): cached decoding equals full recomputation for every family (sliding windows,
// soft-caps, q/k norms, GQA), several prompts of different lengths, stop tokens and samplers.
#include <gtest/gtest.h>

#include <algorithm>

#include "generate/generate.h"
#include "core/error.h"
#include "model/init.h"
#include "test_util.h"

using namespace meshtune;

namespace {

// Greedy continuation by rescoring the whole prefix at each step (no cache reuse).
std::vector<int32_t> greedy_by_recomputation(const GemmaModel& model, std::vector<int32_t> ids, int max_length) {
  const int V = model.config.vocab_size;
  while (int(ids.size()) < max_length) {
    const int64_t T = int64_t(ids.size());
    KVCache cache(model.config, 1, T, meshtune::testing::cpu_backend());
    const FloatBuffer hidden = backbone_forward(meshtune::testing::cpu_context(), model, ids.data(), 1, T, 0, cache);
    std::vector<float> logits(static_cast<size_t>(V));
    const size_t D = size_t(model.config.hidden_dim);
    lm_head(meshtune::testing::cpu_context(), model, hidden.span().part(size_t(T - 1) * D, D), 1, logits);
    ids.push_back(int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()));
  }
  return ids;
}

class CachedGeneration : public ::testing::TestWithParam<std::string> {};

TEST_P(CachedGeneration, EqualsFullRecomputation) {
  GemmaConfig config = preset_config(GetParam(), 97);
  config.sliding_window_size = 3;  // small, so the window really cuts in within 24 tokens
  config.attention_logit_soft_cap = config.family == 2 ? 1.0f : 0.f;
  config.final_logit_soft_cap = config.family == 2 ? 2.0f : 0.f;
  GemmaModel model = random_model(config, 7);
  const int L = 24;
  std::vector<std::vector<int32_t>> prompts = {{2, 5, 9, 11, 40}, {2, 17}, {2, 60, 61, 62, 63, 64, 65, 66, 67}};
  std::vector<std::vector<int32_t>> rows;
  std::vector<std::vector<uint8_t>> masks;
  for (const auto& p : prompts) {
    std::vector<int32_t> row(L, 0);
    std::vector<uint8_t> mask(L, 0);
    std::copy(p.begin(), p.end(), row.begin());
    std::fill(mask.begin(), mask.begin() + long(p.size()), 1);
    rows.push_back(row);
    masks.push_back(mask);
  }
  GenerateOptions options;
  options.max_length = L;
  GeneratedIds got = generate_ids(meshtune::testing::cpu_context(), model, rows, masks, options);
  for (size_t b = 0; b < prompts.size(); ++b) {
    EXPECT_EQ(got.token_ids[b], greedy_by_recomputation(model, prompts[b], L)) << "row " << b;
    EXPECT_TRUE(std::all_of(got.padding_mask[b].begin(), got.padding_mask[b].end(), [](uint8_t m) { return m == 1; }));
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CachedGeneration, ::testing::Values("tiny", "tiny-gemma2", "tiny-gemma3"),
                         [](const auto& info) { return std::string(info.param == "tiny" ? "Gemma1" : info.param == "tiny-gemma2" ? "Gemma2" : "Gemma3"); });

TEST(Generate, StopTokensEndTheMaskLikeKeras) {
  GemmaModel model = random_model(preset_config("tiny", 50), 3);
  const int L = 12;
  std::vector<int32_t> row(L, 0);
  row[0] = 2;
  row[1] = 7;
  std::vector<uint8_t> mask(L, 0);
  mask[0] = mask[1] = 1;
  GenerateOptions options;
  options.max_length = L;
  GeneratedIds free_run = generate_ids(meshtune::testing::cpu_context(), model, {row}, {mask}, options);
  // Use the third generated token as a stop token: the mask must end right after it.
  const int32_t stop = free_run.token_ids[0][4];
  auto first = std::find(free_run.token_ids[0].begin() + 2, free_run.token_ids[0].end(), stop) - free_run.token_ids[0].begin();
  options.stop_token_ids = {stop};
  GeneratedIds stopped = generate_ids(meshtune::testing::cpu_context(), model, {row}, {mask}, options);
  for (int i = 0; i < L; ++i) EXPECT_EQ(int(stopped.padding_mask[0][i]), i <= first ? 1 : 0) << i;
  // Greedy decoding queues steps ahead of the host: those after the stop are dropped, so the row is
  // the free run's up to the stop and its input after it, as a one-step-at-a-time loop leaves it.
  for (int i = 0; i < L; ++i)
    EXPECT_EQ(stopped.token_ids[0][i], i <= first ? free_run.token_ids[0][i] : row[i]) << i;
  // A stop id inside the prompt does not count.
  options.stop_token_ids = {7};
  GeneratedIds in_prompt = generate_ids(meshtune::testing::cpu_context(), model, {row}, {mask}, options);
  EXPECT_EQ(in_prompt.padding_mask[0][2], 1);
}

TEST(Sampler, SeededSamplersRepeatAndRespectTheirSupport) {
  std::vector<float> logits = {0.f, 3.f, 1.f, 2.9f, -1.f, 2.8f, 0.5f};
  for (std::string name : {"top_k", "top_p", "random"}) {
    SamplerOptions o;
    o.name = name;
    o.top_k = 2;
    o.top_p = 0.5f;
    o.seeded = true;
    o.seed = 42;
    Sampler a(o), b(o);
    std::vector<int> seen(logits.size(), 0);
    for (int i = 0; i < 400; ++i) {
      int x = a.sample(logits.data(), int(logits.size()));
      EXPECT_EQ(x, b.sample(logits.data(), int(logits.size())));
      seen[size_t(x)]++;
    }
    if (name == "top_k") {  // only the two most likely tokens (1 and 3)
      EXPECT_GT(seen[1], 0);
      EXPECT_GT(seen[3], 0);
      EXPECT_EQ(seen[1] + seen[3], 400);
    }
    if (name == "top_p") {  // p(1) ≈ 0.37 < 0.5, so tokens 1 and 3 are kept
      EXPECT_EQ(seen[1] + seen[3], 400);
    }
    if (name == "random") EXPECT_GT(seen[0] + seen[2] + seen[4] + seen[6], 0);
  }
  SamplerOptions greedy;
  EXPECT_EQ(Sampler(greedy).sample(logits.data(), int(logits.size())), 1);
  SamplerOptions bad;
  bad.name = "beam";
  EXPECT_THROW(Sampler{bad}, Error);
}

}  // namespace
