#include "backend/batched_attention.h"

#include <algorithm>
#include <functional>

namespace meshtune {

int64_t attention_key_slots(const AttentionShape& s) { return std::min(s.capacity, s.start + s.query_len); }

// One call per (row b, group head g), each batched over the K groups: query/score strides of G heads,
// key/value strides of one head.
static std::vector<BatchedProduct> per_row_and_group_head(
    const AttentionShape& s, const std::function<BatchedProduct(int64_t b, int64_t g)>& make) {
  std::vector<BatchedProduct> products;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t g = 0; g < s.heads / s.kv_heads; ++g) {
      BatchedProduct p = make(b, g);
      p.batch = s.kv_heads;
      products.push_back(p);
    }
  return products;
}

// Strides of the layouts, in floats: q/dout rows [B, T, N, H]; k/v cache [B, S, K, H]; scores
// [B, N, T, L]. Row-major [rows, cols] with a row stride `ld` is column-major [cols, rows], so each
// product below is written as its transpose.
std::vector<BatchedProduct> attention_score_products(const AttentionShape& s) {
  const int64_t T = s.query_len, N = s.heads, K = s.kv_heads, H = s.head_dim, S = s.capacity, G = N / K;
  const int64_t L = attention_key_slots(s);
  // scoresᵀ [L, T] = keysᵀ-as-stored [H, L]ᵀ · x [H, T]
  return per_row_and_group_head(s, [&](int64_t b, int64_t g) {
    BatchedProduct p;
    p.transpose_a = true;
    p.m = L, p.n = T, p.k = H;
    p.a = b * S * K * H, p.lda = K * H, p.stride_a = H;
    p.b = (b * T * N + g) * H, p.ldb = N * H, p.stride_b = G * H;
    p.c = (b * N + g) * T * L, p.ldc = L, p.stride_c = G * T * L;
    return p;
  });
}

std::vector<BatchedProduct> attention_sum_products(const AttentionShape& s) {
  const int64_t T = s.query_len, N = s.heads, K = s.kv_heads, H = s.head_dim, S = s.capacity, G = N / K;
  const int64_t L = attention_key_slots(s);
  // outᵀ [H, T] = values [H, L] · w [L, T]
  return per_row_and_group_head(s, [&](int64_t b, int64_t g) {
    BatchedProduct p;
    p.m = H, p.n = T, p.k = L;
    p.a = b * S * K * H, p.lda = K * H, p.stride_a = H;
    p.b = (b * N + g) * T * L, p.ldb = L, p.stride_b = G * T * L;
    p.c = (b * T * N + g) * H, p.ldc = N * H, p.stride_c = G * H;
    return p;
  });
}

std::vector<BatchedProduct> attention_key_gradient_products(const AttentionShape& s) {
  const int64_t T = s.query_len, N = s.heads, K = s.kv_heads, H = s.head_dim, S = s.capacity, G = N / K;
  const int64_t L = attention_key_slots(s);
  // outᵀ [H, L] += x [H, T] · (w [L, T])ᵀ
  return per_row_and_group_head(s, [&](int64_t b, int64_t g) {
    BatchedProduct p;
    p.transpose_b = true;
    p.m = H, p.n = L, p.k = T;
    p.a = (b * T * N + g) * H, p.lda = N * H, p.stride_a = G * H;
    p.b = (b * N + g) * T * L, p.ldb = L, p.stride_b = G * T * L;
    p.c = b * S * K * H, p.ldc = K * H, p.stride_c = H;
    p.beta = g == 0 ? 0 : 1;  // the first group head writes the slots, the others add to them
    return p;
  });
}

}  // namespace meshtune
