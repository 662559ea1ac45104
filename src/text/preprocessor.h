// GemmaCausalLMPreprocessor for training (spec §5): BOS + tokens[:L−1] + EOS (always, even after
// truncation), right-padded with 0 to L+1, then split into x = ids[:-1], y = ids[1:],
// padding_mask = mask[:-1], sample_weight = mask[1:].
#pragma once
#include <cstdint>
#include <vector>

namespace meshtune {

struct PackedExample {
  std::vector<int32_t> token_ids;      // x, length L
  std::vector<uint8_t> padding_mask;   // mask[:-1], length L
  std::vector<int32_t> targets;        // y, length L
  std::vector<float> sample_weight;    // mask[1:], length L
};

// `tokens` are the text's ids without BOS/EOS. Throws Error if sequence_length < 1.
PackedExample pack_for_training(const std::vector<int>& tokens, int sequence_length, int bos_id, int eos_id,
                                int pad_id);

// A prompt/response pair, as KerasHub's Gemma3CausalLMPreprocessor packs {"prompts", "responses"}:
// [bos] + prompt + response + [eos] packed to L+1 (MultiSegmentPacker, round-robin truncation: one
// token to the prompt, then one to the response, while the L−1 places last), right-padded; x =
// ids[:-1], y = ids[1:], padding_mask = x != pad, sample_weight 1 exactly where the target is a
// response token or the final eos (the answer-only loss).
PackedExample pack_prompt_response(const std::vector<int>& prompt, const std::vector<int>& response,
                                   int sequence_length, int bos_id, int eos_id, int pad_id);

// A conversation's tokens with a 0/1 weight each (text/chat.h): [bos] + tokens[:L], right-padded to
// L+1; x = ids[:-1], y = ids[1:], padding_mask = x != pad, sample_weight = the weight of each target.
PackedExample pack_weighted(const std::vector<int>& tokens, const std::vector<uint8_t>& weights, int sequence_length,
                            int bos_id, int pad_id);

// A pre-tokenized row (BOS, EOS and padding id 0 included, length L+1): x = row[:-1], y = row[1:],
// weight 0 where the target is padding, padding_mask = row[:-1] != pad.
PackedExample pack_pretokenized(const std::vector<int32_t>& row, int pad_id);

}  // namespace meshtune
