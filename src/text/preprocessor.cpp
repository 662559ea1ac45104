#include "text/preprocessor.h"

#include <algorithm>

#include "core/error.h"

namespace meshtune {

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

  PackedExample out;
  out.token_ids.assign(ids.begin(), ids.end() - 1);
  out.padding_mask.assign(mask.begin(), mask.end() - 1);
  out.targets.assign(ids.begin() + 1, ids.end());
  out.sample_weight.resize(L);
  for (size_t i = 0; i < L; ++i) out.sample_weight[i] = mask[i + 1] ? 1.0f : 0.0f;
  return out;
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

  PackedExample out;
  out.token_ids.assign(ids.begin(), ids.end() - 1);
  out.targets.assign(ids.begin() + 1, ids.end());
  out.padding_mask.resize(L);
  out.sample_weight.resize(L);
  for (size_t i = 0; i < L; ++i) {
    out.padding_mask[i] = out.token_ids[i] != pad_id;
    out.sample_weight[i] = in_response[i + 1] ? 1.0f : 0.0f;
  }
  return out;
}

PackedExample pack_weighted(const std::vector<int>& tokens, const std::vector<uint8_t>& weights, int sequence_length,
                            int bos_id, int pad_id) {
  check(sequence_length >= 1, "preprocessor: sequence_length must be >= 1, got ", sequence_length);
  check(weights.size() == tokens.size(), "preprocessor: ", tokens.size(), " tokens but ", weights.size(), " weights");
  const size_t L = size_t(sequence_length), kept = std::min(tokens.size(), L);
  std::vector<int32_t> ids(L + 1, int32_t(pad_id));
  std::vector<uint8_t> trained(L + 1, 0);
  ids[0] = bos_id;
  for (size_t i = 0; i < kept; ++i) ids[1 + i] = tokens[i], trained[1 + i] = weights[i];
  PackedExample out;
  out.token_ids.assign(ids.begin(), ids.end() - 1);
  out.targets.assign(ids.begin() + 1, ids.end());
  out.padding_mask.resize(L);
  out.sample_weight.resize(L);
  for (size_t i = 0; i < L; ++i) {
    out.padding_mask[i] = i < kept + 1;
    out.sample_weight[i] = trained[i + 1] ? 1.0f : 0.0f;
  }
  return out;
}

PackedExample pack_pretokenized(const std::vector<int32_t>& row, int pad_id) {
  check(row.size() >= 2, "preprocessor: a pre-tokenized row needs at least 2 ids, got ", row.size());
  const size_t L = row.size() - 1;
  PackedExample out;
  out.token_ids.assign(row.begin(), row.end() - 1);
  out.targets.assign(row.begin() + 1, row.end());
  out.padding_mask.resize(L);
  out.sample_weight.resize(L);
  for (size_t i = 0; i < L; ++i) {
    out.padding_mask[i] = row[i] != pad_id ? 1 : 0;
    out.sample_weight[i] = row[i + 1] != pad_id ? 1.0f : 0.0f;
  }
  return out;
}

}  // namespace meshtune
