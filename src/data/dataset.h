// Training data sources (`--data SPEC`). SPEC is `KIND:PATH` or a PATH whose kind is detected:
//   tfrecord:PATH   TFRecord files as tfds writes them for imdb_reviews (a file, or a directory of
//                   *.tfrecord* files read in name order): tf.train.Example with a `text` bytes
//                   feature; length and data CRC32C (masked) checked.
//   aclimdb:PATH    the aclImdb folder: PATH/train/{pos,neg,unsup}/*.txt (or PATH given as the
//                   split folder itself); files in name order, pos, neg, unsup.
//   jsonl:PATH      one JSON object per line; the text is field `text_field` (default "text"), or
//                   a prompt/response pair (fields `prompt_field` / `response_field`, default
//                   "prompts" / "responses", also "prompt" / "response"), for the answer-only loss,
//                   or a conversation {"messages": [{"role", "content"}, …]} (Gemma's chat template).
//   text:PATH       plain text, one example per line (blank lines skipped); a directory: one
//                   example per *.txt file.
//   npy:PATH        pre-tokenized int32 [N, T+1] rows (BOS, EOS and padding 0 included).
//   sample          the project's own sample movie reviews (data/sample_reviews.h), built in.
//   sample-chat     the project's own question/answer conversations (data/sample_chat.h), built in.
// Detection without a prefix: directory with train/ → aclimdb; *.jsonl → jsonl; *.npy → npy;
// *.tfrecord* → tfrecord; other files → text.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "text/chat.h"

namespace meshtune {

struct Dataset {
  std::string source;  // the SPEC, for messages
  std::vector<std::string> texts;                // text sources (the prompts when there are responses)
  std::vector<std::string> responses;            // prompt/response sources: one per text, else empty
  std::vector<std::vector<ChatMessage>> conversations;  // {"messages": [...]} sources
  std::vector<std::vector<int32_t>> token_rows;  // npy source: each row T+1 ids
  bool pretokenized() const { return !token_rows.empty(); }
  size_t size() const {
    return pretokenized() ? token_rows.size() : !conversations.empty() ? conversations.size() : texts.size();
  }
};

// Reads every example. Throws Error naming the file (and line/record) for a missing file, a bad
// CRC, a record that is not a tf.train.Example or lacks the feature, a JSONL line that is not JSON
// or lacks the field, a malformed .npy, or an empty data set.
struct DataFields {
  std::string text = "text", prompt = "prompts", response = "responses";
};
Dataset load_dataset(const std::string& spec, const DataFields& fields = {});

// Writes a TFRecord file holding tf.train.Example records with one bytes feature `text` (tests,
// and users converting their own data). Atomic.
void write_tfrecord_texts(const std::string& path, const std::vector<std::string>& texts);

}  // namespace meshtune
