// Gemma's chat format: the template's text against the strings in shared/fixtures/keras2/chat (and
// Gemma's template rules for system messages and several turns), the token ids Keras' tokenizer
// gives them, the answer-only weights, conversations in JSONL, and `generate --chat` against
// Keras' greedy generation from the same prompt.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "data/batches.h"
#include "data/dataset.h"
#include "test_util.h"
#include "text/chat.h"
#include "text/preprocessor.h"
#include "text/tokenizer.h"

namespace meshtune {
namespace {

using nlohmann::json;
using testing::fixture;

const std::string kVocabulary = "keras/preset-gemma-tiny/assets/tokenizer/vocabulary.spm";

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Chat, TemplateRendersAsGemmas) {
  const json inputs = testing::load_json(fixture("keras2/chat/inputs.json"));
  EXPECT_EQ(render_gemma_chat({{"user", "What does the license allow?"}}, true), inputs["chat_template_prompts"][0]);
  EXPECT_EQ(render_gemma_chat({{"user", "Hi"}, {"assistant", "Hello"}, {"user", "Who?"}}, true),
            inputs["chat_template_prompts"][1]);
  // Gemma has no system role: the system text opens the first user turn, then a blank line;
  // contents are trimmed; "assistant" is rendered "model".
  EXPECT_EQ(render_gemma_chat({{"system", "Be brief."}, {"user", " Hi \n"}, {"model", "Hello"}}, false),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n");
  const std::string sys = "<start_of_turn>user\nS\n\n";
  EXPECT_EQ(render_gemma_chat({{"system", "S"}, {"user", "a"}}, true), sys + "a<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_EQ(render_gemma_chat({{"system", "S"}, {"user", "a"}, {"model", "b"}, {"user", "c"}, {"model", "d"}}, false),
            sys + "a<end_of_turn>\n<start_of_turn>model\nb<end_of_turn>\n<start_of_turn>user\nc<end_of_turn>\n"
                  "<start_of_turn>model\nd<end_of_turn>\n");
  EXPECT_EQ(render_gemma_chat({{"system", "S"}, {"user", "a"}, {"model", "b"}, {"user", "c"}, {"model", "d"}, {"user", "e"},
                               {"model", "f"}},
                              false),
            sys + "a<end_of_turn>\n<start_of_turn>model\nb<end_of_turn>\n<start_of_turn>user\nc<end_of_turn>\n"
                  "<start_of_turn>model\nd<end_of_turn>\n<start_of_turn>user\ne<end_of_turn>\n<start_of_turn>model\nf"
                  "<end_of_turn>\n");
  EXPECT_EQ(render_gemma_chat({{"user", "a"}, {"assistant", "b"}, {"user", "c"}, {"assistant", "d"}, {"user", "e"},
                               {"assistant", "f"}},
                              false),
            "<start_of_turn>user\na<end_of_turn>\n<start_of_turn>model\nb<end_of_turn>\n<start_of_turn>user\nc"
            "<end_of_turn>\n<start_of_turn>model\nd<end_of_turn>\n<start_of_turn>user\ne<end_of_turn>\n"
            "<start_of_turn>model\nf<end_of_turn>\n");
}

TEST(Chat, TokensAreKerasTokenizersAndOnlyModelTurnsAreTrained) {
  const Tokenizer tok(fixture(kVocabulary));
  const json inputs = testing::load_json(fixture("keras2/chat/inputs.json"));
  const std::vector<int32_t> keras = testing::npy_ints(fixture("keras2/chat/chat_template_generate_preprocess_token_ids.npy"));
  const std::vector<int32_t> mask = testing::npy_ints(fixture("keras2/chat/chat_template_generate_preprocess_padding_mask.npy"));
  const std::vector<std::vector<ChatMessage>> conversations = {
      {{"user", "What does the license allow?"}},
      {{"user", "Hi"}, {"assistant", "Hello"}, {"user", "Who?"}}};
  for (size_t b = 0; b < 2; ++b) {
    // Keras tokenized the whole string; we tokenize the template's pieces one by one.
    std::vector<int> ids = {tok.bos_id()};
    for (const ChatSegment& s : chat_segments(conversations[b], true))
      for (int id : tok.encode(s.text)) ids.push_back(id);
    for (int id : tok.encode("<start_of_turn>model\n")) ids.push_back(id);
    std::vector<int> want;
    for (size_t t = 0; t < 48; ++t)
      if (mask[b * 48 + t]) want.push_back(keras[b * 48 + t]);
    EXPECT_EQ(ids, want) << "conversation " << b;
  }
  // Weights: the model's answer and its <end_of_turn>, nothing else.
  const std::vector<ChatMessage> chat = {{"user", "Hi"}, {"assistant", "Hello"}, {"user", "Who?"}, {"model", "Us"}};
  std::string trained;
  for (const ChatSegment& s : chat_segments(chat, false))
    if (s.trained) trained += s.text + "|";
  EXPECT_EQ(trained, "Hello<end_of_turn>|Us<end_of_turn>|");
  for (const ChatSegment& s : chat_segments(chat, true)) EXPECT_TRUE(s.trained);
}

TEST(Chat, ConversationsInJsonl) {
  const std::string dir = testing::make_temp_dir("chatjsonl");
  const std::string path = dir + "/chat.jsonl";
  auto write = [&](const std::string& text) { std::ofstream(path) << text; };
  write(R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})" "\n"
        R"({"messages": [{"role": "user", "content": "Who?"}, {"role": "model", "content": "Us."}]})" "\n");
  const Dataset d = load_dataset(path);
  ASSERT_EQ(d.conversations.size(), 2u);
  EXPECT_EQ(d.conversations[0][2].content, "Hello");

  // A batch: weight 1 exactly on the targets that are the answer's tokens and its <end_of_turn>.
  const Tokenizer tok(fixture(kVocabulary));
  BatchOptions o;
  o.sequence_length = 40;
  o.batch_size = 2;
  o.shuffle = false;
  const Batch batch = BatchStream(d, &tok, o).batch(0, 0);
  const int eot = tok.piece_to_id("<end_of_turn>");
  std::vector<int> trained;
  for (size_t t = 0; t < 40; ++t)
    if (batch.sample_weight[40 + t] == 1.f) trained.push_back(batch.targets[40 + t]);
  std::vector<int> answer = tok.encode("Us.");
  answer.push_back(eot);
  EXPECT_EQ(trained, answer);

  write(R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "x"}]})" "\n");
  EXPECT_NE(error_of([&] { load_dataset(path); }).find("line 1: message 1 has role \"robot\""), std::string::npos)
      << error_of([&] { load_dataset(path); });
  write(R"({"messages": [{"role": "user", "content": "Hi"}]})" "\n");
  EXPECT_NE(error_of([&] { load_dataset(path); }).find("does not end with a model turn"), std::string::npos);
  write(R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"}]})" "\n");
  EXPECT_NE(error_of([&] { load_dataset(path); }).find("must alternate"), std::string::npos);
  write(R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "model", "content": "  "}]})" "\n");
  EXPECT_NE(error_of([&] { load_dataset(path); }).find("empty model turn"), std::string::npos);
  write(R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "model", "content": "Hello"}]}
{"text": "not a conversation"})" "\n");
  EXPECT_NE(error_of([&] { load_dataset(path); }).find("line 2"), std::string::npos) << error_of([&] { load_dataset(path); });
  write(R"({"messages": [{"role": "user", "content": 3}]})" "\n");
  EXPECT_NE(error_of([&] { load_dataset(path); }).find("messages[0].content"), std::string::npos)
      << error_of([&] { load_dataset(path); });
  std::filesystem::remove_all(dir);
}

// generate --chat renders the prompt as a user turn; greedy, no stop, 48 tokens: Keras' ids.
TEST(Chat, GenerateChatEqualsKerasGreedy) {
  const testing::CommandResult r = testing::run_meshtune(
      "generate '" + fixture("keras/preset-gemma-tiny") +
      "' --chat --prompt 'What does the license allow?' --max-length 48 --no-stop --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::vector<int32_t> keras = testing::npy_ints(fixture("keras2/chat/chat_template_generate_greedy_token_ids.npy"));
  const json j = json::parse(r.out);
  EXPECT_EQ(j["token_ids"].get<std::vector<int32_t>>(), std::vector<int32_t>(keras.begin(), keras.begin() + 48));
  EXPECT_EQ(j["prompt"], "What does the license allow?");
}

// Fine-tuning on conversations runs end to end.
TEST(Chat, FinetuneOnConversations) {
  const std::string dir = testing::make_temp_dir("chatft");
  std::ofstream(dir + "/chat.jsonl")
      << R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})" "\n"
      << R"({"messages": [{"role": "user", "content": "Who?"}, {"role": "model", "content": "Us."}]})" "\n";
  const testing::CommandResult r = testing::run_meshtune("finetune '" + fixture("keras/preset-gemma-tiny") + "' --data '" +
                                                         dir + "/chat.jsonl' --batch-size 2 --seq-len 24 --steps 2 "
                                                         "--no-progress --out '" + dir + "/run'");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_GT(json::parse(r.out)["loss"].get<double>(), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace meshtune
