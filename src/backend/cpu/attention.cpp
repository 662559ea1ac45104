#include "backend/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/batched_attention.h"


namespace meshtune {

namespace {

// One attention logit: q·k, soft-capped when the shape asks for it.
float attention_score(const cpu::VectorOps& ops, const float* qv, const float* kj, int64_t H, float cap) {
  const float dot = ops.dot(qv, kj, H);
  return cap > 0 ? std::tanh(dot / cap) * cap : dot;
}

// ∂(capped logit)/∂(raw logit) = 1 − tanh², with tanh = capped/cap.
float soft_cap_slope(float score, float cap) {
  if (cap <= 0) return 1.f;
  const float t = score / cap;
  return 1.f - t * t;
}

// The logits of query qv against keys first..last of its batch row and KV head (−∞ for a padding
// key) into scores[first..last]; returns their maximum (−∞ when no key is allowed).
float query_scores(const cpu::VectorOps& ops, const float* qv, const float* k, const uint8_t* key_valid,
                   const AttentionShape& s, int64_t b, int64_t kv, int64_t first, int64_t last, float* scores) {
  const int64_t S = s.capacity, K = s.kv_heads, H = s.head_dim;
  float max_score = -INFINITY;
  for (int64_t j = first; j <= last; ++j) {
    scores[j] = key_valid[b * S + j] ? attention_score(ops, qv, k + ((b * S + j) * K + kv) * H, H, s.soft_cap)
                                     : -INFINITY;
    max_score = std::max(max_score, scores[j]);
  }
  return max_score;
}

// The arrays the products read, rounded to bf16 under bf16_products (AttentionShape): queries or
// output gradients [B, T, N, H] whole, keys and values [B, S, K, H] in the slots a query may read
// (attention_key_slots; the rest zero). Without bf16_products they are the caller's arrays.
class ProductInputs {
 public:
  ProductInputs(const AttentionShape& s) : s_(s) {}
  const float* queries(const float* x) { return round(x, s_.batch * s_.query_len * s_.heads * s_.head_dim); }
  const float* slots(const float* x) {
    const int64_t row = s_.kv_heads * s_.head_dim;  // one key slot
    return round(x, s_.batch * s_.capacity * row, attention_key_slots(s_) * row, s_.capacity * row);
  }

 private:
  // Rounds x's first `used` values of each `period` (all of them when period is 1).
  const float* round(const float* x, int64_t n, int64_t used = 1, int64_t period = 1) {
    if (!s_.bf16_products) return x;
    std::vector<float>& r = copies_.emplace_back(size_t(n), 0.f);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i)
      if (period == 1 || i % period < used) r[size_t(i)] = round_to_bf16(x[i]);
    return r.data();
  }
  const AttentionShape& s_;
  std::vector<std::vector<float>> copies_;
};

}  // namespace

void attention(const KernelPath& path, const float* q, const float* k, const float* v, const uint8_t* key_valid, const AttentionShape& s,
               float* out) {
  const int64_t B = s.batch, T = s.query_len, S = s.capacity, N = s.heads, K = s.kv_heads, H = s.head_dim;
  const int64_t group = N / K;
  const cpu::VectorOps& ops = path.ops();
  ProductInputs rounded(s);
  q = rounded.queries(q), k = rounded.slots(k), v = rounded.slots(v);
#pragma omp parallel
  {
    std::vector<float> scores(static_cast<size_t>(S));
#pragma omp for collapse(3) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t n = 0; n < N; ++n) {
          const int64_t pos = s.start + t, kv = n / group;
          const float* qv = q + ((b * T + t) * N + n) * H;
          float* o = out + ((b * T + t) * N + n) * H;
          const int64_t first = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
          const int64_t last = std::min(pos, S - 1);
          std::fill(o, o + H, 0.f);
          const float max_score = query_scores(ops, qv, k, key_valid, s, b, kv, first, last, scores.data());
          if (max_score == -INFINITY) continue;  // no allowed key: the row stays zero
          const float inv = 1.f / ops.exp_shifted(scores.data() + first, last - first + 1, max_score);
          for (int64_t j = first; j <= last; ++j)
            if (scores[j] != 0.f) ops.axpy(s.product_input(scores[j] * inv), v + ((b * S + j) * K + kv) * H, o, H);
        }
  }
}

// Two passes, FlashAttention-2 style, so that no two threads ever write the same gradient row:
//  1. per query row (b, t, n): recompute the probabilities P, keep the row's softmax statistics
//     (max, 1/sum) and delta = Σ_j P_j·dP_j with dP_j = dO·v_j, and write
//     dq = Σ_j dS_j·k_j with dS_j = P_j·(dP_j − delta)·cap'(s_j).
//  2. per key row (b, j, kv): rebuild P_j and dS_j for every query that sees key j (from the
//     saved statistics) and write dk_j = Σ dS·q and dv_j = Σ P·dO over those queries and the
//     query heads sharing kv head kv.
// This parallelises over B·T·N and B·T·K rows, which stays busy even for batch 1 with one KV head.
void attention_backward(const KernelPath& path, const float* q, const float* k, const float* v, const uint8_t* key_valid,
                        const AttentionShape& s, const float* dout, float* dq, float* dk, float* dv) {
  const int64_t B = s.batch, T = s.query_len, S = s.capacity, N = s.heads, K = s.kv_heads, H = s.head_dim;
  const int64_t group = N / K;
  const cpu::VectorOps& ops = path.ops();
  const size_t rows = static_cast<size_t>(B * T * N);
  // Per query row; row_inv_sum = 0 marks a row with no allowed key (all its probabilities are 0).
  std::vector<float> row_max(rows, 0.f), row_inv_sum(rows, 0.f), row_delta(rows, 0.f);
  ProductInputs rounded(s);
  q = rounded.queries(q), dout = rounded.queries(dout), k = rounded.slots(k), v = rounded.slots(v);

  // Pass 1: softmax statistics and dq.
#pragma omp parallel
  {
    std::vector<float> scores(static_cast<size_t>(S)), probs(static_cast<size_t>(S)), dprobs(static_cast<size_t>(S));
#pragma omp for collapse(3) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t n = 0; n < N; ++n) {
          const int64_t pos = s.start + t, kv = n / group, row = (b * T + t) * N + n;
          const float* qv = q + row * H;
          const float* dov = dout + row * H;
          float* dqv = dq + row * H;
          std::fill(dqv, dqv + H, 0.f);
          const int64_t first = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
          const int64_t last = std::min(pos, S - 1);
          const float max_score = query_scores(ops, qv, k, key_valid, s, b, kv, first, last, scores.data());
          if (max_score == -INFINITY) continue;  // no allowed key: zero output, zero gradient
          std::copy(scores.begin() + first, scores.begin() + last + 1, probs.begin() + first);
          const float inv = 1.f / ops.exp_shifted(probs.data() + first, last - first + 1, max_score);
          float delta = 0;
          for (int64_t j = first; j <= last; ++j) {
            probs[j] = s.product_input(probs[j] * inv);
            dprobs[j] = probs[j] == 0.f ? 0.f : ops.dot(dov, v + ((b * S + j) * K + kv) * H, H);
            delta += probs[j] * dprobs[j];
          }
          for (int64_t j = first; j <= last; ++j) {
            if (probs[j] == 0.f) continue;
            const float ds = s.product_input(probs[j] * (dprobs[j] - delta) * soft_cap_slope(scores[j], s.soft_cap));
            ops.axpy(ds, k + ((b * S + j) * K + kv) * H, dqv, H);
          }
          row_max[row] = max_score;
          row_inv_sum[row] = inv;
          row_delta[row] = delta;
        }
  }

  // Pass 2: dk and dv, one key row per iteration.
#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < S; ++j)
      for (int64_t kv = 0; kv < K; ++kv) {
        const float* kj = k + ((b * S + j) * K + kv) * H;
        const float* vj = v + ((b * S + j) * K + kv) * H;
        float* dkj = dk + ((b * S + j) * K + kv) * H;
        float* dvj = dv + ((b * S + j) * K + kv) * H;
        std::fill(dkj, dkj + H, 0.f);
        std::fill(dvj, dvj + H, 0.f);
        if (!key_valid[b * S + j]) continue;  // padding keys get probability 0 everywhere
        // Queries at positions j .. j+W−1 (or all from j without a window) see key j.
        const int64_t t_first = std::max<int64_t>(0, j - s.start);
        const int64_t t_last = s.window > 0 ? std::min(T - 1, j + s.window - 1 - s.start) : T - 1;
        for (int64_t t = t_first; t <= t_last; ++t)
          for (int64_t n = kv * group; n < (kv + 1) * group; ++n) {
            const int64_t row = (b * T + t) * N + n;
            if (row_inv_sum[row] == 0.f) continue;
            const float* qv = q + row * H;
            const float* dov = dout + row * H;
            const float score = attention_score(ops, qv, kj, H, s.soft_cap);
            const float p = s.product_input(ops.exp(score - row_max[row]) * row_inv_sum[row]);
            if (p == 0.f) continue;
            const float ds =
                s.product_input(p * (ops.dot(dov, vj, H) - row_delta[row]) * soft_cap_slope(score, s.soft_cap));
            ops.axpy(ds, qv, dkj, H);
            ops.axpy(p, dov, dvj, H);
          }
      }
}

}  // namespace meshtune
