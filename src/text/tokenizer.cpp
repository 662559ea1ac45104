#include "text/tokenizer.h"

#include <algorithm>

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <unordered_map>

#include "core/error.h"
#include "core/file_util.h"

namespace meshtune {

namespace {

// sentencepiece's PieceToId returns the unk id for an unknown piece, so a piece is present only if
// mapping the id back gives the same piece.
int find_piece(const sentencepiece::SentencePieceProcessor& sp, const std::string& piece) {
  int id = sp.PieceToId(piece);
  if (id < 0 || id >= sp.GetPieceSize()) return -1;
  return sp.IdToPiece(id) == piece ? id : -1;
}

// Feeds the caller's sentences to the trainer without a temp file.
class VectorSentenceIterator : public sentencepiece::SentenceIterator {
 public:
  explicit VectorSentenceIterator(const std::vector<std::string>& sentences) : sentences_(sentences) {}
  bool done() const override { return index_ >= sentences_.size(); }
  void Next() override { ++index_; }
  const std::string& value() const override { return sentences_[index_]; }
  sentencepiece::util::Status status() const override { return sentencepiece::util::Status(); }  // default is OK

 private:
  const std::vector<std::string>& sentences_;
  size_t index_ = 0;
};

}  // namespace

Tokenizer::Tokenizer(const std::string& model_path)
    : path_(model_path), processor_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {
  // Check existence first: sentencepiece's own message for a missing file is less clear.
  std::error_code ec;
  if (!std::filesystem::exists(model_path, ec)) fail_not_found("tokenizer file ", model_path, ": not found");
  if (!std::filesystem::is_regular_file(model_path, ec)) fail("tokenizer file ", model_path, ": not a regular file");
  const auto status = processor_->Load(model_path);
  if (!status.ok()) {
    fail("tokenizer file ", model_path, ": not a SentencePiece model (", status.ToString(), ")");
  }
  if (processor_->GetPieceSize() <= 0) fail("tokenizer file ", model_path, ": empty vocabulary");

  // Gemma's ids are 0/1/2; look them up by name so other vocabularies work, with Gemma's as fallback.
  int pad = find_piece(*processor_, "<pad>"), eos = find_piece(*processor_, "<eos>"),
      bos = find_piece(*processor_, "<bos>");
  pad_id_ = pad >= 0 ? pad : 0;
  eos_id_ = eos >= 0 ? eos : 1;
  bos_id_ = bos >= 0 ? bos : 2;
}

Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

std::vector<int> Tokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  const auto status = processor_->Encode(text, &ids);
  if (!status.ok()) fail("tokenizer ", path_, ": cannot encode text: ", status.ToString());
  return ids;
}

std::vector<std::string> Tokenizer::encode_pieces(const std::string& text) const {
  std::vector<std::string> pieces;
  const auto status = processor_->Encode(text, &pieces);
  if (!status.ok()) fail("tokenizer ", path_, ": cannot encode text: ", status.ToString());
  return pieces;
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  // DecodeIds would silently return "" for an out-of-range id; say which id is wrong instead.
  const int n = vocab_size();
  for (int id : ids) {
    if (id < 0 || id >= n) fail("tokenizer ", path_, ": cannot decode id ", id, " (vocabulary size ", n, ")");
  }
  return processor_->DecodeIds(ids);
}

int Tokenizer::vocab_size() const { return processor_->GetPieceSize(); }

int Tokenizer::piece_to_id(const std::string& piece) const { return find_piece(*processor_, piece); }

std::string Tokenizer::id_to_piece(int id) const {
  // sentencepiece does not range-check IdToPiece.
  if (id < 0 || id >= vocab_size()) {
    fail("tokenizer ", path_, ": id ", id, " out of range (vocabulary size ", vocab_size(), ")");
  }
  return processor_->IdToPiece(id);
}

void train_tokenizer(const std::vector<std::string>& sentences, int vocab_size, const std::string& out_path) {
  if (sentences.empty()) fail("tokenizer training for ", out_path, ": no sentences");
  if (vocab_size <= 0) fail("tokenizer training for ", out_path, ": vocab_size must be positive, got ", vocab_size);

  // Mirrors the options that made the shared Gemma fixture tokenizer
  // (shared/fixtures/keras/tokenizer-training.json), with Gemma's special ids and no dummy prefix.
  // hard_vocab_limit stays at its default (true): the model has exactly vocab_size pieces or
  // training fails.
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", "unigram"},
      {"vocab_size", std::to_string(vocab_size)},
      {"pad_id", "0"},
      {"eos_id", "1"},
      {"bos_id", "2"},
      {"unk_id", "3"},
      {"pad_piece", "<pad>"},
      {"eos_piece", "<eos>"},
      {"bos_piece", "<bos>"},
      {"unk_piece", "<unk>"},
      {"user_defined_symbols", "<start_of_turn>,<end_of_turn>"},
      {"byte_fallback", "true"},
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"split_digits", "true"},
      {"allow_whitespace_only_pieces", "true"},
      {"normalization_rule_name", "identity"},
      {"character_coverage", "1.0"},
      {"num_threads", "1"},
      {"input_sentence_size", "0"},
      {"shuffle_input_sentence", "false"},
      {"train_extremely_large_corpus", "false"},
      {"minloglevel", "2"},
  };

  // Train into memory (no model_prefix, so no .model/.vocab files), then write atomically.
  VectorSentenceIterator iterator(sentences);
  std::string serialized;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &iterator, &serialized);
  if (!status.ok()) fail("tokenizer training for ", out_path, " failed: ", status.ToString());

  write_file_atomic(out_path, serialized);
}

std::string_view tokenizable_prefix(std::string_view text, int sequence_length) {
  // A piece spans at most 16 characters (SentencePiece's max_sentencepiece_length) of at most 4
  // bytes, so the first L tokens come from the first 64·L bytes; the cut lies 4× beyond that, at
  // a space or line break, so it changes no token that is used.
  const size_t keep = std::max<size_t>(size_t(64) << 10, size_t(sequence_length) * 64 * 4);
  if (text.size() <= keep) return text;
  const size_t cut = text.find_first_of(" \n\t", keep);
  return text.substr(0, cut == std::string_view::npos ? std::min(text.size(), keep * 2) : cut);
}


}  // namespace meshtune
