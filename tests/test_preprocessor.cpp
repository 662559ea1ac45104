// The training preprocessor (spec §5) against the gemma-tiny worked example, with ids taken from
// the fixture tokenizer and summary, and pre-tokenized rows.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "test_util.h"
#include "text/preprocessor.h"
#include "text/tokenizer.h"

namespace meshtune {
namespace {

using nlohmann::json;
using testing::fixture;

const std::string kKerasModel = "keras/preset-gemma-tiny/assets/tokenizer/vocabulary.spm";

std::vector<int> slice(const std::vector<int>& v, size_t n) { return std::vector<int>(v.begin(), v.begin() + long(n)); }
std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int>& b, std::vector<int32_t> c) {
  a.insert(a.end(), b.begin(), b.end());
  a.insert(a.end(), c.begin(), c.end());
  return a;
}

// Keras' fixture ids for the summary's tokenization entry that starts with `prefix`.
std::vector<int> fixture_ids(const std::string& prefix) {
  json entries = json::parse(testing::read_text_file(fixture("keras/summary-gemma-tiny.json")))["tokenization"];
  for (const auto& e : entries) {
    if (e["text"].get<std::string>().rfind(prefix, 0) == 0) return e["keras_tokenizer_ids"].get<std::vector<int>>();
  }
  ADD_FAILURE() << "no fixture entry starting with " << prefix;
  return {};
}

// Spec §5, L=12: a 20-token text is truncated to 11 tokens and still ends with EOS as a target.
TEST(Preprocessor, SpecExampleTruncated) {
  Tokenizer tok(fixture(kKerasModel));
  const std::string text = "The licenses for most software are designed to take away your freedom.";
  const std::vector<int> ids = tok.encode(text);
  ASSERT_EQ(ids, fixture_ids(text));
  ASSERT_EQ(ids.size(), 20u);

  PackedExample p = pack_for_training(ids, 12, tok.bos_id(), tok.eos_id(), tok.pad_id());
  EXPECT_EQ(p.token_ids, concat({2}, slice(ids, 11), {}));
  EXPECT_EQ(p.targets, concat({}, slice(ids, 11), {1}));
  EXPECT_EQ(p.padding_mask, std::vector<uint8_t>(12, 1));
  EXPECT_EQ(p.sample_weight, std::vector<float>(12, 1.0f));
  // The spec's literal numbers, as a cross-check of the fixture.
  EXPECT_EQ(p.token_ids, (std::vector<int32_t>{2, 549, 323, 268, 291, 628, 328, 367, 341, 691, 272, 265}));
}

// Spec §5, L=12: "Copyright 2024" (6 tokens) is padded; EOS is a target, BOS is not.
TEST(Preprocessor, SpecExamplePadded) {
  Tokenizer tok(fixture(kKerasModel));
  const std::vector<int> ids = tok.encode("Copyright 2024");
  ASSERT_EQ(ids.size(), 6u);
  // The fixture tokenizes "Copyright 2024 holders"; its first 6 ids are this text's.
  ASSERT_EQ(ids, slice(fixture_ids("Copyright 2024"), 6));

  PackedExample p = pack_for_training(ids, 12, tok.bos_id(), tok.eos_id(), tok.pad_id());
  EXPECT_EQ(p.token_ids, concat({2}, ids, {1, 0, 0, 0, 0}));
  EXPECT_EQ(p.targets, concat({}, ids, {1, 0, 0, 0, 0, 0}));
  std::vector<uint8_t> mask(12, 0);
  std::fill(mask.begin(), mask.begin() + 8, 1);
  EXPECT_EQ(p.padding_mask, mask);
  std::vector<float> weight(12, 0.0f);
  std::fill(weight.begin(), weight.begin() + 7, 1.0f);
  EXPECT_EQ(p.sample_weight, weight);
}

TEST(Preprocessor, EdgeLengths) {
  // L=1: only BOS fits in x; the single target is EOS.
  PackedExample one = pack_for_training({5, 6, 7}, 1, 2, 1, 0);
  EXPECT_EQ(one.token_ids, (std::vector<int32_t>{2}));
  EXPECT_EQ(one.targets, (std::vector<int32_t>{1}));
  EXPECT_EQ(one.sample_weight, (std::vector<float>{1.0f}));
  // Exactly L-1 tokens: no padding, no truncation.
  PackedExample full = pack_for_training({5, 6, 7}, 4, 2, 1, 0);
  EXPECT_EQ(full.token_ids, (std::vector<int32_t>{2, 5, 6, 7}));
  EXPECT_EQ(full.targets, (std::vector<int32_t>{5, 6, 7, 1}));
  // No tokens at all: BOS -> EOS, then padding.
  PackedExample empty = pack_for_training({}, 3, 2, 1, 0);
  EXPECT_EQ(empty.token_ids, (std::vector<int32_t>{2, 1, 0}));
  EXPECT_EQ(empty.padding_mask, (std::vector<uint8_t>{1, 1, 0}));
  EXPECT_EQ(empty.targets, (std::vector<int32_t>{1, 0, 0}));
  EXPECT_EQ(empty.sample_weight, (std::vector<float>{1, 0, 0}));
}

TEST(Preprocessor, SequenceLengthZeroFails) {
  EXPECT_THROW(pack_for_training({5}, 0, 2, 1, 0), Error);
  EXPECT_THROW(pack_for_training({5}, -3, 2, 1, 0), Error);
}

// A pre-tokenized row equals what pack_for_training makes from the same tokens.
TEST(Preprocessor, Pretokenized) {
  PackedExample p = pack_pretokenized({2, 10, 11, 1, 0, 0}, 0);
  EXPECT_EQ(p.token_ids, (std::vector<int32_t>{2, 10, 11, 1, 0}));
  EXPECT_EQ(p.targets, (std::vector<int32_t>{10, 11, 1, 0, 0}));
  EXPECT_EQ(p.padding_mask, (std::vector<uint8_t>{1, 1, 1, 1, 0}));
  EXPECT_EQ(p.sample_weight, (std::vector<float>{1, 1, 1, 0, 0}));

  PackedExample q = pack_for_training({10, 11}, 5, 2, 1, 0);
  EXPECT_EQ(p.token_ids, q.token_ids);
  EXPECT_EQ(p.targets, q.targets);
  EXPECT_EQ(p.padding_mask, q.padding_mask);
  EXPECT_EQ(p.sample_weight, q.sample_weight);

  EXPECT_THROW(pack_pretokenized({2}, 0), Error);
}

// {"prompts", "responses"} packing against shared/fixtures/keras2/chat (KerasHub's tokenizer and
// MultiSegmentPacker, following gemma3_causal_lm_preprocessor.py): three short pairs and one pair
// that round-robin truncation cuts.
TEST(Preprocessor, PromptResponsePairsMatchKerasHub) {
  Tokenizer tok(fixture(kKerasModel));
  const json inputs = testing::load_json(fixture("keras2/chat/inputs.json"));
  const int L = inputs["sequence_length"].get<int>();
  for (const std::string name : {"pairs", "long_pair"}) {
    SCOPED_TRACE(name);
    const json& pairs = inputs[name == "pairs" ? "chat_pairs" : "long_pair"];
    const std::string base = fixture("keras2/chat/expected_" + name + "_");
    const std::vector<int32_t> x = testing::npy_ints(base + "x_token_ids.npy"), y = testing::npy_ints(base + "y.npy"),
                               mask = testing::npy_ints(base + "x_padding_mask.npy"),
                               weight = testing::npy_ints(base + "sample_weight.npy");
    const size_t n = pairs["prompts"].size();
    ASSERT_EQ(x.size(), n * size_t(L));
    for (size_t b = 0; b < n; ++b) {
      const PackedExample p = pack_prompt_response(tok.encode(pairs["prompts"][b].get<std::string>()),
                                                   tok.encode(pairs["responses"][b].get<std::string>()), L, tok.bos_id(),
                                                   tok.eos_id(), tok.pad_id());
      for (size_t t = 0; t < size_t(L); ++t) {
        const size_t i = b * size_t(L) + t;
        EXPECT_EQ(p.token_ids[t], x[i]) << "row " << b << " position " << t;
        EXPECT_EQ(p.targets[t], y[i]) << "row " << b << " position " << t;
        EXPECT_EQ(int(p.padding_mask[t]), mask[i]) << "row " << b << " position " << t;
        EXPECT_EQ(int(p.sample_weight[t]), weight[i]) << "row " << b << " position " << t;
      }
    }
  }
}

}  // namespace
}  // namespace meshtune
