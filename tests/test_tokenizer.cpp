// The SentencePiece tokenizer against the Keras and HF fixtures (ids, pieces, detokenization,
// special ids), its errors, and training a small Gemma-style model.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "test_util.h"
#include "text/tokenizer.h"

namespace meshtune {
namespace {

using nlohmann::json;
using testing::fixture;
using testing::make_temp_dir;
using testing::read_text_file;
using testing::load_json;

const std::string kKerasModel = "keras/preset-gemma-tiny/assets/tokenizer/vocabulary.spm";
const std::string kKeras2Model = "keras/preset-gemma2-tiny/assets/tokenizer/vocabulary.spm";
const std::string kHfModel = "hf/tiny-gemma/checkpoint/tokenizer.model";

template <typename F>
void expect_error(F f, const std::string& path, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected an Error for " << path;
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << "wanted '" << fragment << "' in: " << msg;
  }
}

// Every "tokenization" entry of a Keras summary: ids, pieces and detokenized text.
void check_keras_summary(const std::string& summary, const std::string& model) {
  Tokenizer tok(fixture(model));
  json entries = load_json(fixture(summary))["tokenization"];
  ASSERT_FALSE(entries.empty());
  for (const auto& e : entries) {
    const std::string text = e["text"].get<std::string>();
    SCOPED_TRACE(text);
    std::vector<int> ids = tok.encode(text);
    EXPECT_EQ(ids, e["keras_tokenizer_ids"].get<std::vector<int>>());
    EXPECT_EQ(ids, e["spm_encode_ids"].get<std::vector<int>>());
    EXPECT_EQ(tok.encode_pieces(text), e["pieces"].get<std::vector<std::string>>());
    EXPECT_EQ(tok.decode(ids), e["detokenized"].get<std::string>());
  }
}

TEST(Tokenizer, KerasGemmaSummary) { check_keras_summary("keras/summary-gemma-tiny.json", kKerasModel); }

TEST(Tokenizer, KerasGemma2Summary) { check_keras_summary("keras/summary-gemma2-tiny.json", kKeras2Model); }

// The HF fixture lists sentencepiece's ids (ours must equal them) and llama.cpp's.
TEST(Tokenizer, HfTokenizeFixture) {
  Tokenizer tok(fixture(kHfModel));
  json entries = load_json(fixture("hf/tiny-gemma/tokenize.json"));
  ASSERT_FALSE(entries.empty());
  for (const auto& e : entries) {
    const std::string text = e["text"].get<std::string>();
    SCOPED_TRACE(text);
    std::vector<int> ids = tok.encode(text);
    EXPECT_EQ(ids, e["sentencepiece"].get<std::vector<int>>());
    // sentencepiece's decode gives the text back except where the text holds a literal U+2581,
    // which decodes as a space (as llama.cpp's detokenizer also does).
    const std::string decoded = tok.decode(ids);
    EXPECT_EQ(decoded == text, e["sp_decode_roundtrip"].get<bool>()) << decoded;
    EXPECT_EQ(decoded, e["llama_detok_plain"].get<std::string>());
  }
}

TEST(Tokenizer, SpecialIds) {
  json training = load_json(fixture("keras/tokenizer-training.json"));
  const std::vector<std::string> vocab = training["vocab"].get<std::vector<std::string>>();
  for (const std::string& model : {kKerasModel, kKeras2Model, kHfModel}) {
    SCOPED_TRACE(model);
    Tokenizer tok(fixture(model));
    EXPECT_EQ(tok.path(), fixture(model));
    EXPECT_EQ(tok.pad_id(), 0);
    EXPECT_EQ(tok.eos_id(), 1);
    EXPECT_EQ(tok.bos_id(), 2);
    EXPECT_EQ(tok.id_to_piece(tok.pad_id()), "<pad>");
    EXPECT_EQ(tok.id_to_piece(tok.eos_id()), "<eos>");
    EXPECT_EQ(tok.id_to_piece(tok.bos_id()), "<bos>");
    EXPECT_EQ(tok.piece_to_id("<unk>"), 3);
    for (const std::string piece : {"<start_of_turn>", "<end_of_turn>"}) {
      int id = tok.piece_to_id(piece);
      ASSERT_GE(id, 0) << piece;
      EXPECT_EQ(tok.id_to_piece(id), piece);
      // User-defined pieces are matched in raw text.
      EXPECT_EQ(tok.encode(piece), std::vector<int>({id}));
    }
    EXPECT_EQ(tok.piece_to_id("<no_such_piece>"), -1);
    EXPECT_EQ(tok.piece_to_id(""), -1);
  }
  // The Keras model is the one tokenizer-training.json describes: same vocabulary, in order.
  Tokenizer tok(fixture(kKerasModel));
  ASSERT_EQ(tok.vocab_size(), int(vocab.size()));
  for (int i = 0; i < tok.vocab_size(); ++i) EXPECT_EQ(tok.id_to_piece(i), vocab[i]) << i;
  for (const std::string piece : {"<start_of_turn>", "<end_of_turn>"}) {
    EXPECT_EQ(tok.piece_to_id(piece), int(std::find(vocab.begin(), vocab.end(), piece) - vocab.begin()));
  }
}

TEST(Tokenizer, EmptyTextAndMove) {
  Tokenizer tok(fixture(kKerasModel));
  EXPECT_TRUE(tok.encode("").empty());
  EXPECT_EQ(tok.decode({}), "");
  Tokenizer moved(std::move(tok));
  EXPECT_EQ(moved.decode(moved.encode("Copyright 2024 holders")), "Copyright 2024 holders");
  Tokenizer other(fixture(kHfModel));
  other = std::move(moved);
  EXPECT_EQ(other.path(), fixture(kKerasModel));
}

TEST(Tokenizer, BadIdsThrow) {
  Tokenizer tok(fixture(kKerasModel));
  const std::string path = fixture(kKerasModel);
  expect_error([&] { tok.decode({5, tok.vocab_size()}); }, path, "cannot decode id");
  expect_error([&] { tok.decode({-1}); }, path, "cannot decode id");
  expect_error([&] { tok.id_to_piece(tok.vocab_size()); }, path, "out of range");
}

TEST(Tokenizer, MissingAndGarbageFilesNameTheFile) {
  const std::string dir = make_temp_dir("tok");
  const std::string missing = dir + "/missing.model";
  expect_error([&] { Tokenizer t(missing); }, missing, "not found");

  expect_error([&] { Tokenizer t(dir); }, dir, "not a regular file");

  const std::string garbage = dir + "/garbage.model";
  {
    std::ofstream out(garbage, std::ios::binary);
    for (int i = 0; i < 4096; ++i) out.put(char((i * 131 + 7) % 251));
  }
  expect_error([&] { Tokenizer t(garbage); }, garbage, "not a SentencePiece model");

  const std::string text = dir + "/text.model";
  { std::ofstream(text) << "this is a plain text file, not a model\n"; }
  expect_error([&] { Tokenizer t(text); }, text, "not a SentencePiece model");

  const std::string empty = dir + "/empty.model";
  { std::ofstream out(empty); }
  expect_error([&] { Tokenizer t(empty); }, empty, "tokenizer file");
}

// 200 deterministic sentences over a small alphabet: with byte fallback the 4 special + 2 turn +
// 256 byte pieces take 262 of the 300 ids, and every character of the corpus needs its own piece
// (character_coverage 1.0), so the corpus may use only a few dozen distinct characters.
std::vector<std::string> make_corpus() {
  const std::string consonants = "dlmnrst", vowels = "aeiou";
  uint32_t state = 12345;
  auto next = [&state](uint32_t n) {  // a fixed LCG, so the corpus is the same on every platform
    state = state * 1664525u + 1013904223u;
    return (state >> 8) % n;
  };
  std::vector<std::string> words;
  for (int w = 0; w < 40; ++w) {
    std::string word;
    for (uint32_t syl = 0, n = 1 + next(3); syl < n; ++syl) {
      word += consonants[next(uint32_t(consonants.size()))];
      word += vowels[next(uint32_t(vowels.size()))];
    }
    words.push_back(word);
  }
  std::vector<std::string> out;
  for (int i = 0; i < 200; ++i) {
    std::string s;
    for (uint32_t k = 0, n = 4 + next(6); k < n; ++k) s += (k ? " " : "") + words[next(uint32_t(words.size()))];
    s += " " + std::to_string(next(4)) + std::to_string(next(4)) + ".";
    if (i % 5 == 0) s = "<start_of_turn>user\n" + s + "<end_of_turn>";
    out.push_back(s);
  }
  return out;
}

TEST(Tokenizer, TrainSmallModel) {
  const std::string dir = make_temp_dir("tok");
  const std::string path = dir + "/small.model";
  const std::vector<std::string> corpus = make_corpus();
  train_tokenizer(corpus, 300, path);

  // Only the model is left behind: no .tmp, no .vocab.
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) files.push_back(entry.path().filename().string());
  EXPECT_EQ(files, std::vector<std::string>({"small.model"}));

  Tokenizer tok(path);
  EXPECT_EQ(tok.vocab_size(), 300);
  const std::vector<std::string> specials = {"<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"};
  for (int i = 0; i < int(specials.size()); ++i) {
    EXPECT_EQ(tok.id_to_piece(i), specials[i]);
    EXPECT_EQ(tok.piece_to_id(specials[i]), i);
  }
  EXPECT_EQ(tok.pad_id(), 0);
  EXPECT_EQ(tok.eos_id(), 1);
  EXPECT_EQ(tok.bos_id(), 2);
  // Byte fallback pieces follow the special ones.
  EXPECT_EQ(tok.id_to_piece(6), "<0x00>");

  for (const std::string& s : corpus) EXPECT_EQ(tok.decode(tok.encode(s)), s);
  // Unseen characters go through byte fallback, whitespace is kept as is.
  const std::string unseen = "  naïve 日本語\ttabs\n\nand 🙂 9876  ";
  EXPECT_EQ(tok.decode(tok.encode(unseen)), unseen);
  std::vector<int> turn = tok.encode("<start_of_turn>user\nhi<end_of_turn>");
  ASSERT_FALSE(turn.empty());
  EXPECT_EQ(turn.front(), 4);
  EXPECT_EQ(turn.back(), 5);
  // No dummy prefix: the first word is not given a leading "▁"; digits are split.
  const std::string first_word = corpus[1].substr(0, corpus[1].find(' '));
  std::vector<std::string> pieces = tok.encode_pieces(first_word + " 1230");
  ASSERT_GE(pieces.size(), 5u);
  EXPECT_NE(pieces.front().rfind("\xe2\x96\x81", 0), 0u) << pieces.front();
  EXPECT_EQ(std::vector<std::string>(pieces.end() - 4, pieces.end()), std::vector<std::string>({"1", "2", "3", "0"}));

  // Deterministic: a second training gives the same bytes.
  const std::string again = dir + "/again.model";
  train_tokenizer(corpus, 300, again);
  EXPECT_TRUE(read_text_file(path) == read_text_file(again));
}

TEST(Tokenizer, TrainErrorsNameTheFile) {
  const std::string dir = make_temp_dir("tok");
  const std::string path = dir + "/too_big.model";
  // Far more pieces than three short sentences can supply.
  expect_error([&] { train_tokenizer({"a b c", "d e f", "g h i"}, 5000, path); }, path, "failed");
  EXPECT_FALSE(std::filesystem::exists(path));
  expect_error([&] { train_tokenizer({}, 300, path); }, path, "no sentences");
  expect_error([&] { train_tokenizer({"a"}, 0, path); }, path, "vocab_size");
}

}  // namespace
}  // namespace meshtune
