// Batches for fit(): a reproducible order (shuffled per epoch from a seed, or in file order),
// `take` examples, each tokenized and packed (text/preprocessor.h), grouped into batches (the last
// one may be smaller, as tf.data's batch()). batch(epoch, step) is a pure function of its
// arguments, so resuming at (epoch, step) continues exactly where an interrupted run stopped.
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

#include "data/dataset.h"
#include "text/preprocessor.h"
#include "text/tokenizer.h"

namespace meshtune {

struct Batch {
  int64_t batch_size = 0, seq_len = 0;   // B, L
  std::vector<int32_t> token_ids;        // [B, L]
  std::vector<uint8_t> padding_mask;     // [B, L]
  std::vector<int32_t> targets;          // [B, L]
  std::vector<float> sample_weight;      // [B, L]
};

struct BatchOptions {
  int sequence_length = 128;
  int batch_size = 2;
  size_t take = 0;            // 0 = all examples
  bool shuffle = true;
  uint64_t shuffle_seed = 0;
  bool train_on_all_turns = false;  // conversations: the loss on every token, not only the model's turns
};


class BatchStream {
 public:
  // `tokenizer` may be null for a pre-tokenized data set. Texts are tokenized once, up front.
  // Throws Error for an empty data set, sequence_length < 1 or batch_size < 1, or a pre-tokenized
  // row length that differs from sequence_length + 1 (the error names the source and row).
  BatchStream(const Dataset& data, const Tokenizer* tokenizer, const BatchOptions& options);
  size_t steps_per_epoch() const;
  size_t num_examples() const;
  Batch batch(size_t epoch, size_t step) const;
  // Prompt/response pairs and conversations: how many examples keep no token to train on (their
  // prompt fills every position of sequence_length, so the answer is cut off entirely).
  size_t examples_without_targets() const;

 private:
  PackedExample pack(size_t i) const;  // example i as a row of the batch

  BatchOptions options_;
  std::vector<std::vector<int>> token_lists_;     // text sources (or prompts), tokenized (no BOS/EOS)
  std::vector<std::vector<int>> response_lists_;  // prompt/response sources: the responses
  std::vector<std::vector<uint8_t>> weight_lists_;  // conversations: a 0/1 weight per token
  std::vector<std::vector<int32_t>> rows_;     // pre-tokenized sources
  int bos_ = 2, eos_ = 1, pad_ = 0;
};

}  // namespace meshtune
