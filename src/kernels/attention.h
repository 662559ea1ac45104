// Causal multi-query / grouped-query attention over a key/value cache (spec §1.4):
// query head n uses KV head n / (N/K); scores = q·k (q already scaled), optional soft-cap,
// masked entries excluded, softmax in fp32, masked probabilities exactly 0, rows with no allowed
// key give zeros.
#pragma once
#include <cstdint>

namespace meshtune {

struct AttentionShape {
  int64_t batch = 0;      // B
  int64_t query_len = 0;  // T: queries of row b sit at positions start .. start+T-1
  int64_t start = 0;
  int64_t capacity = 0;   // S: key slots in the cache per row
  int64_t heads = 0;      // N
  int64_t kv_heads = 0;   // K
  int64_t head_dim = 0;   // H
  int64_t window = 0;     // sliding window W (key j allowed iff pos − W < j), 0 = none
  float soft_cap = 0;     // 0 = none
};

// q, out: [B, T, N, H]; k, v: [B, S, K, H]; key_valid: [B, S] (0 = padding key).
// Query at position p may attend to key j iff j ≤ p, key_valid[b, j], and the window allows it.
void attention(const float* q, const float* k, const float* v, const uint8_t* key_valid, const AttentionShape& s,
               float* out);

}  // namespace meshtune

namespace meshtune {

// Backward of attention for training (start = 0, capacity = query_len = T: k and v are the
// sequence's own keys/values [B, T, K, H]). Recomputes the probabilities from q and k, then writes
// dq [B, T, N, H] and dk, dv [B, T, K, H] (overwritten, not accumulated).
void attention_backward(const float* q, const float* k, const float* v, const uint8_t* key_valid,
                        const AttentionShape& s, const float* dout, float* dq, float* dk, float* dv);

}  // namespace meshtune
