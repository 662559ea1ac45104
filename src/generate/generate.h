// generate() with KerasHub's semantics (spec §6): max_length counts BOS + prompt + new tokens;
// generation starts at the shortest prompt, keeps prompt tokens where the prompt mask is set, and
// stops when every row has produced a stop token after its prompt; the returned mask ends at each
// row's first stop token. A KV cache makes each step cost one token, and gives exactly the tokens
// a full recomputation gives.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "generate/sampler.h"
#include "model/gemma.h"
#include "text/tokenizer.h"

namespace meshtune {

struct GenerateOptions {
  int max_length = 64;
  std::vector<int> stop_token_ids;  // empty = never stop early
  SamplerOptions sampler;
};

// Token-level generate on right-padded rows: token_ids/padding_mask are [B][max_length] (the
// prompt where the mask is 1). Returns the filled token ids and the output padding mask.
struct GeneratedIds {
  std::vector<std::vector<int32_t>> token_ids;
  std::vector<std::vector<uint8_t>> padding_mask;
};
GeneratedIds generate_ids(const Context& ctx, const GemmaModel& model, std::vector<std::vector<int32_t>> token_ids,
                          std::vector<std::vector<uint8_t>> padding_mask, const GenerateOptions& options);

// String-level generate: BOS + tokenized prompt (cut to max_length − 1 tokens), several prompts
// at once with padding, then Keras' postprocess (drop padding and special tokens, detokenize).
struct GeneratedText {
  std::string prompt;
  std::string text;        // the prompt followed by the completion, as Keras' generate returns it
  std::string completion;  // only the new text (Keras' strip_prompt=True)
  std::vector<int32_t> token_ids;  // BOS, prompt and generated ids, through the first stop token
  int prompt_length = 0;           // ids of BOS + prompt
};
std::vector<GeneratedText> generate_text(const Context& ctx, const GemmaModel& model, const Tokenizer& tokenizer,
                                         const std::vector<std::string>& prompts, const GenerateOptions& options);

// The stop tokens KerasHub uses for stop_token_ids="auto": <eos>, plus <end_of_turn> for Gemma 3.
std::vector<int> default_stop_token_ids(const GemmaModel& model, const Tokenizer& tokenizer);

}  // namespace meshtune
