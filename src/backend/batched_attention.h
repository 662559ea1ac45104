// Attention as strided-batched matrix products — the CUDA backend's MESHTUNE_CUDA_ATTENTION=gemm
// route. Which products, in cuBLAS' column-major terms, give the scores, the weighted sums and the
// key gradients of every (row b, query head n): host-only descriptions, so that their index
// arithmetic is tested on any machine (tests/test_batched_attention.cpp runs them with plain loops
// against the reference backend's attention).
//
// Score rows are [B, N, T, L] floats: L = attention_key_slots(s), the key slots any query may attend
// to (min(S, start + T); later cache slots may hold anything, and a product would read them). Query
// head n = kv·G + g (G = N / K) uses key/value head kv: each description is one call per (row b,
// head g of a group), batched over the K groups.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/op_types.h"

namespace meshtune {

// C = op(A)·op(B) + beta·C over `batch` matrices; a, b, c are offsets in floats from the operands'
// bases, each batch `stride_*` floats further.
struct BatchedProduct {
  bool transpose_a = false, transpose_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t a = 0, lda = 0, stride_a = 0;
  int64_t b = 0, ldb = 0, stride_b = 0;
  int64_t c = 0, ldc = 0, stride_c = 0;
  int64_t batch = 0;
  float beta = 0;
};

int64_t attention_key_slots(const AttentionShape& s);

// scores[b, n, t, j] = x[b, t, n, :]·keys[b, j, kv, :]   (A = keys, B = x: q or dout; C = scores)
std::vector<BatchedProduct> attention_score_products(const AttentionShape& s);
// out[b, t, n, :] = Σ_j w[b, n, t, j]·values[b, j, kv, :]   (A = values: v or k, B = w: P or dS; C = out)
std::vector<BatchedProduct> attention_sum_products(const AttentionShape& s);
// out[b, j, kv, :] = Σ_{g, t} w[b, kv·G + g, t, j]·x[b, t, kv·G + g, :] for the slots j < L (A = x,
// B = w; C = out: the products for g = 0 write it, the others add; slots L … S−1 are the caller's to
// zero)
std::vector<BatchedProduct> attention_key_gradient_products(const AttentionShape& s);

}  // namespace meshtune
