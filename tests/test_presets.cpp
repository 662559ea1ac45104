// Gemma variants as data: every KerasHub preset in the spec's table (§1.7, parsed from the spec
// itself) has its shape and parameter count; the attention pattern and stop tokens are data.
#include <gtest/gtest.h>

#include <sstream>

#include "core/error.h"
#include "model/presets.h"
#include "test_util.h"

using namespace meshtune;
using namespace meshtune::testing;

namespace {

std::vector<std::string> cells(const std::string& row) {
  std::vector<std::string> out;
  std::stringstream in(row);
  std::string cell;
  std::getline(in, cell, '|');  // before the first bar
  while (std::getline(in, cell, '|')) {
    const size_t b = cell.find_first_not_of(" *"), e = cell.find_last_not_of(" *");
    out.push_back(b == std::string::npos ? "" : cell.substr(b, e - b + 1));
  }
  return out;
}

int64_t number(std::string text) {  // "2,506,172,416" / "32768 (16384)" / "–"
  text = text.substr(0, text.find(' '));
  std::string digits;
  for (char ch : text)
    if (ch >= '0' && ch <= '9') digits += ch;
  return digits.empty() ? 0 : std::stoll(digits);
}

}  // namespace

TEST(Presets, EveryKerasHubPresetOfTheSpecHasItsShapeAndParameterCount) {
  const std::string spec = read_text_file(std::string(MESHTUNE_SOURCE_DIR) + "/../shared/spec/keras-gemma.md");
  const size_t start = spec.find("### 1.7 Preset configs");
  ASSERT_NE(start, std::string::npos);
  std::stringstream lines(spec.substr(start, spec.find("### 1.8", start) - start));
  int checked = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("| gemma", 0) != 0) continue;
    const std::vector<std::string> c = cells(line);
    ASSERT_GE(c.size(), 10u) << line;
    std::string name = c[0].substr(0, c[0].find_first_of(",/ "));
    SCOPED_TRACE(name);
    const GemmaConfig g = preset_config(name);
    EXPECT_EQ(g.vocab_size, number(c[1]));
    EXPECT_EQ(g.num_layers, number(c[2]));
    EXPECT_EQ(g.num_query_heads, number(c[3]));
    EXPECT_EQ(g.num_key_value_heads, number(c[4]));
    EXPECT_EQ(g.hidden_dim, number(c[5]));
    EXPECT_EQ(g.keras_intermediate_dim(), number(c[6]));
    EXPECT_EQ(g.head_dim, number(c[7]));
    EXPECT_EQ(g.use_sliding_window_attention ? g.sliding_window_size : 0, number(c[8]));
    EXPECT_EQ(g.num_parameters(), number(c[9]));
    ++checked;
  }
  EXPECT_EQ(checked, 10);
  EXPECT_EQ(preset_config("gemma_instruct_7b_en").num_parameters(), preset_config("gemma_7b_en").num_parameters());
}

TEST(Presets, AttentionPatternAndStopTokensAreData) {
  const GemmaConfig g2 = preset_config("gemma2_2b_en"), g3 = preset_config("gemma3_1b"), g1 = preset_config("gemma_2b_en");
  for (int layer = 0; layer < 12; ++layer) {
    EXPECT_EQ(g2.is_sliding(layer), layer % 2 == 0) << layer;   // even layers local
    EXPECT_EQ(g3.is_sliding(layer), layer % 6 != 5) << layer;   // five local, one global
    EXPECT_FALSE(g1.is_sliding(layer));
    EXPECT_EQ(g3.rope_base(layer), layer % 6 == 5 ? 1e6f : 10000.f) << layer;
    EXPECT_EQ(g2.rope_base(layer), 10000.f);
  }
  GemmaConfig every_third = g3;
  every_third.sliding_window_pattern = 3;
  EXPECT_FALSE(every_third.is_sliding(2));
  EXPECT_TRUE(every_third.is_sliding(3));
  EXPECT_TRUE(g1.stop_tokens.empty());
  EXPECT_EQ(g3.stop_tokens, std::vector<std::string>{"<end_of_turn>"});
  EXPECT_EQ(std::string(g3.names().hf_model_type), "gemma3_text");
  EXPECT_EQ(std::string(g1.names().hf_pre_ffw_norm), "post_attention_layernorm");
}

TEST(Presets, UnknownNameListsTheKnownOnes) {
  try {
    preset_config("gemma_3b_en");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gemma2_9b_en"), std::string::npos) << e.what();
  }
}
