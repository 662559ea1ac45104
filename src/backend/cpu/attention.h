// Causal multi-query / grouped-query attention over a key/value cache (spec §1.4):
// query head n uses KV head n / (N/K); scores = q·k (q already scaled), optional soft-cap,
// masked entries excluded, softmax in fp32, masked probabilities exactly 0, rows with no allowed
// key give zeros.
#pragma once
#include <cstdint>

#include "backend/op_types.h"
#include "backend/cpu/kernel_path.h"

namespace meshtune {


// q, out: [B, T, N, H]; k, v: [B, S, K, H]; key_valid: [B, S] (0 = padding key).
// Query at position p may attend to key j iff j ≤ p, key_valid[b, j], and the window allows it.
void attention(const KernelPath& path, const float* q, const float* k, const float* v, const uint8_t* key_valid, const AttentionShape& s,
               float* out);

}  // namespace meshtune

namespace meshtune {

// Backward of attention for training (start = 0, capacity = query_len = T: k and v are the
// sequence's own keys/values [B, T, K, H]). Recomputes the probabilities from q and k, then writes
// dq [B, T, N, H] and dk, dv [B, T, K, H] (overwritten, not accumulated).
void attention_backward(const KernelPath& path, const float* q, const float* k, const float* v, const uint8_t* key_valid,
                        const AttentionShape& s, const float* dout, float* dq, float* dk, float* dv);

}  // namespace meshtune
