// The Gemma tokenizer: a SentencePiece model (Keras `assets/tokenizer/vocabulary.spm`, HF
// `tokenizer.model`) run by libsentencepiece, so ids equal sentencepiece's own. Plain encode adds
// no BOS/EOS (the preprocessor and generate add them, as Keras does).
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace sentencepiece { class SentencePieceProcessor; }

namespace meshtune {

class Tokenizer {
 public:
  // Throws Error naming the file if it is missing or not a SentencePiece model.
  explicit Tokenizer(const std::string& model_path);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  std::vector<int> encode(std::string_view text) const;
  std::vector<std::string> encode_pieces(const std::string& text) const;
  // Detokenizes ids as they are (the caller drops special ids first, as Keras generate does).
  std::string decode(const std::vector<int>& ids) const;

  int vocab_size() const;
  int pad_id() const { return pad_id_; }  // "<pad>", 0 in Gemma
  int eos_id() const { return eos_id_; }  // "<eos>", 1
  int bos_id() const { return bos_id_; }  // "<bos>", 2
  // Id of a piece such as "<end_of_turn>", or -1 if the vocabulary lacks it.
  int piece_to_id(const std::string& piece) const;
  std::string id_to_piece(int id) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::unique_ptr<sentencepiece::SentencePieceProcessor> processor_;
  int pad_id_ = 0, eos_id_ = 1, bos_id_ = 2;
};

// Trains a small Gemma-style SentencePiece model (unigram, pad 0 / eos 1 / bos 2 / unk 3, then
// <start_of_turn> <end_of_turn> as user-defined pieces, byte fallback, identity normalization) on the
// given sentences and writes it to `out_path`. Deterministic for the same input (one thread).
void train_tokenizer(const std::vector<std::string>& sentences, int vocab_size, const std::string& out_path);

// The part of an example's text that tokenizing needs when only the first `sequence_length` tokens
// are used (a training row, a prompt cut to max_length − 1): all of it up to 64 KiB (or 256·L bytes), beyond that cut at the next space or line break
// (SentencePiece needs ~150 bytes of memory per input byte, so a 4 MB line would cost 600 MB).
std::string_view tokenizable_prefix(std::string_view text, int sequence_length);

}  // namespace meshtune
