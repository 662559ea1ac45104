#include "text/preprocessor.h"

#include <algorithm>

#include "core/error.h"

namespace meshtune {

namespace {

// The packed row ids[L+1] shifted by one, as every Keras causal-LM preprocessor does: x = ids[:-1],
// y = ids[1:], padding_mask = real[:-1], sample_weight = trained[1:] (the weight of each target).
PackedExample shifted(const std::vector<int32_t>& ids, const std::vector<uint8_t>& real,
                      const std::vector<uint8_t>& trained) {
  const size_t L = ids.size() - 1;
  PackedExample out;
  out.token_ids.assign(ids.begin(), ids.end() - 1);
  out.targets.assign(ids.begin() + 1, ids.end());
  out.padding_mask.assign(real.begin(), real.end() - 1);
  out.sample_weight.resize(L);
  for (size_t i = 0; i < L; ++i) out.sample_weight[i] = trained[i + 1] ? 1.0f : 0.0f;
  return out;
}

}  // namespace

PackedExample pack_for_training(const std::vector<int>& tokens, int sequence_length, int bos_id, int eos_id,
                                int pad_id) {
  check(sequence_length >= 1, "preprocessor: sequence_length must be >= 1, got ", sequence_length);
  const size_t L = size_t(sequence_length);
  // BOS + tokens[:L-1] + EOS, right-padded to L+1. EOS is appended even after truncation (Keras
  // StartEndPacker), so the packed length is at most L+1 and never needs cutting again.
  const size_t kept = std::min(tokens.size(), L - 1);
  std::vector<int32_t> ids(L + 1, int32_t(pad_id));
  std::vector<uint8_t> mask(L + 1, 0);
  ids[0] = bos_id;
  for (size_t i = 0; i < kept; ++i) ids[1 + i] = tokens[i];
  ids[1 + kept] = eos_id;
  std::fill(mask.begin(), mask.begin() + long(kept + 2), uint8_t(1));
  return shifted(ids, mask, mask);
}

PackedExample pack_prompt_response(const std::vector<int>& prompt, const std::vector<int>& response,
                                   int sequence_length, int bos_id, int eos_id, int pad_id) {
  check(sequence_length >= 1, "preprocessor: sequence_length must be >= 1, got ", sequence_length);
  const size_t L = size_t(sequence_length);
  // Round-robin truncation to the L−1 places between bos and eos.
  size_t budget = L - 1, keep_prompt = 0, keep_response = 0;
  while (budget > 0 && (keep_prompt < prompt.size() || keep_response < response.size())) {
    if (keep_prompt < prompt.size()) keep_prompt++, budget--;
    if (budget > 0 && keep_response < response.size()) keep_response++, budget--;
  }
  std::vector<int32_t> ids(L + 1, int32_t(pad_id));
  std::vector<uint8_t> in_response(L + 1, 0);  // MultiSegmentPacker's segment id 1 (eos included)
  size_t n = 0;
  ids[n++] = bos_id;
  for (size_t i = 0; i < keep_prompt; ++i) ids[n++] = prompt[i];
  for (size_t i = 0; i < keep_response; ++i) in_response[n] = 1, ids[n++] = response[i];
  in_response[n] = 1;
  ids[n++] = eos_id;
  std::vector<uint8_t> real(L + 1);
  for (size_t i = 0; i <= L; ++i) real[i] = ids[i] != pad_id;
  return shifted(ids, real, in_response);
}

PackedExample pack_weighted(const std::vector<int>& tokens, const std::vector<uint8_t>& weights, int sequence_length,
                            int bos_id, int pad_id) {
  check(sequence_length >= 1, "preprocessor: sequence_length must be >= 1, got ", sequence_length);
  check(weights.size() == tokens.size(), "preprocessor: ", tokens.size(), " tokens but ", weights.size(), " weights");
  const size_t L = size_t(sequence_length), kept = std::min(tokens.size(), L);
  std::vector<int32_t> ids(L + 1, int32_t(pad_id));
  std::vector<uint8_t> real(L + 1, 0), trained(L + 1, 0);
  ids[0] = bos_id;
  for (size_t i = 0; i < kept; ++i) ids[1 + i] = tokens[i], trained[1 + i] = weights[i];
  std::fill(real.begin(), real.begin() + long(kept + 1), uint8_t(1));  // bos and the kept tokens
  return shifted(ids, real, trained);
}

PackedExample pack_pretokenized(const std::vector<int32_t>& row, int pad_id) {
  check(row.size() >= 2, "preprocessor: a pre-tokenized row needs at least 2 ids, got ", row.size());
  std::vector<uint8_t> real(row.size());
  for (size_t i = 0; i < row.size(); ++i) real[i] = row[i] != pad_id;
  return shifted(row, real, real);
}

}  // namespace meshtune
