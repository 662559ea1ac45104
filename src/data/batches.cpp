#include "data/batches.h"

#include <algorithm>
#include <random>

#include "core/error.h"
#include "text/preprocessor.h"

namespace meshtune {

namespace {

// Uniform integer in [0, bound) by rejection, so the result depends only on the engine's outputs
// (std::uniform_int_distribution's algorithm is implementation-defined).
uint64_t uniform_below(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound: the biased low range
  while (true) {
    const uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

// The example order of one epoch: a Fisher–Yates permutation from a seed mixed with the epoch.
std::vector<size_t> epoch_order(size_t n, bool shuffle, uint64_t seed, size_t epoch) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  if (!shuffle) return order;
  std::mt19937_64 rng(seed ^ (uint64_t(epoch) * 0x9E3779B97F4A7C15ull));
  for (size_t i = n; i > 1; --i) {
    const size_t j = size_t(uniform_below(rng, i));
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

}  // namespace


BatchStream::BatchStream(const Dataset& data, const Tokenizer* tokenizer, const BatchOptions& options)
    : options_(options) {
  check(data.size() > 0, "data ", data.source, ": no examples");
  check(options.sequence_length >= 1, "sequence_length must be >= 1, got ", options.sequence_length);
  check(options.batch_size >= 1, "batch_size must be >= 1, got ", options.batch_size);
  if (tokenizer) {
    bos_ = tokenizer->bos_id();
    eos_ = tokenizer->eos_id();
    pad_ = tokenizer->pad_id();
  }
  // `take` keeps the first examples in file order, before any shuffling (as ds.take(n) would).
  const size_t n = options.take > 0 ? std::min(options.take, data.size()) : data.size();
  if (data.pretokenized()) {
    const size_t want = size_t(options.sequence_length) + 1;
    rows_.assign(data.token_rows.begin(), data.token_rows.begin() + long(n));
    for (size_t r = 0; r < n; ++r) {
      check(rows_[r].size() == want, "data ", data.source, ": row ", r, " has ", rows_[r].size(),
            " ids, but sequence_length ", options.sequence_length, " needs ", want);
    }
  } else {
    check(tokenizer != nullptr, "data ", data.source, ": a text data set needs a tokenizer");
    auto tokenize = [&](const std::string& text) {
      std::vector<int> tokens = tokenizer->encode(tokenizable_prefix(text, options.sequence_length));
      if (tokens.size() > size_t(options.sequence_length)) tokens.resize(size_t(options.sequence_length));  // never used
      return tokens;
    };
    token_lists_.reserve(n);
    for (size_t i = 0; i < n && data.conversations.empty(); ++i) token_lists_.push_back(tokenize(data.texts[i]));
    for (size_t i = 0; i < n && !data.conversations.empty(); ++i) {
      // Each piece of the rendered template on its own: pieces meet at special tokens and line
      // breaks, and each piece's tokens take its weight.
      std::vector<int> tokens;
      std::vector<uint8_t> weights;
      for (const ChatSegment& segment : chat_segments(data.conversations[i], options.train_on_all_turns)) {
        if (tokens.size() >= size_t(options.sequence_length)) break;  // the rest is never used
        for (int id : tokenize(segment.text)) tokens.push_back(id), weights.push_back(segment.trained);
      }
      token_lists_.push_back(std::move(tokens));
      weight_lists_.push_back(std::move(weights));
    }
    if (!data.responses.empty()) {
      check(data.responses.size() == data.texts.size(), "data ", data.source, ": prompts and responses differ in number");
      for (size_t i = 0; i < n; ++i) response_lists_.push_back(tokenize(data.responses[i]));
    }
  }
}

size_t BatchStream::num_examples() const { return rows_.empty() ? token_lists_.size() : rows_.size(); }

size_t BatchStream::steps_per_epoch() const {
  const size_t b = size_t(options_.batch_size);
  return (num_examples() + b - 1) / b;
}

PackedExample BatchStream::pack(size_t i) const {
  return !rows_.empty()           ? pack_pretokenized(rows_[i], pad_)
         : !weight_lists_.empty()  ? pack_weighted(token_lists_[i], weight_lists_[i], options_.sequence_length, bos_, pad_)
         : response_lists_.empty() ? pack_for_training(token_lists_[i], options_.sequence_length, bos_, eos_, pad_)
                                   : pack_prompt_response(token_lists_[i], response_lists_[i], options_.sequence_length,
                                                          bos_, eos_, pad_);
}

size_t BatchStream::examples_without_targets() const {
  if (response_lists_.empty() && weight_lists_.empty()) return 0;  // plain texts always have a next token
  size_t count = 0;
  for (size_t i = 0; i < num_examples(); ++i) {
    const PackedExample p = pack(i);
    count += std::none_of(p.sample_weight.begin(), p.sample_weight.end(), [](float w) { return w > 0; });
  }
  return count;
}

Batch BatchStream::batch(size_t epoch, size_t step) const {
  check(step < steps_per_epoch(), "batch step ", step, " out of range: an epoch has ", steps_per_epoch(), " steps");
  const std::vector<size_t> order =
      epoch_order(num_examples(), options_.shuffle, options_.shuffle_seed, epoch);
  const size_t begin = step * size_t(options_.batch_size);
  const size_t end = std::min(begin + size_t(options_.batch_size), order.size());

  Batch out;
  out.batch_size = int64_t(end - begin);
  out.seq_len = options_.sequence_length;
  const size_t total = size_t(out.batch_size) * size_t(out.seq_len);
  out.token_ids.reserve(total);
  out.padding_mask.reserve(total);
  out.targets.reserve(total);
  out.sample_weight.reserve(total);
  for (size_t k = begin; k < end; ++k) {
    const PackedExample p = pack(order[k]);
    out.token_ids.insert(out.token_ids.end(), p.token_ids.begin(), p.token_ids.end());
    out.padding_mask.insert(out.padding_mask.end(), p.padding_mask.begin(), p.padding_mask.end());
    out.targets.insert(out.targets.end(), p.targets.begin(), p.targets.end());
    out.sample_weight.insert(out.sample_weight.end(), p.sample_weight.begin(), p.sample_weight.end());
  }
  return out;
}

}  // namespace meshtune
