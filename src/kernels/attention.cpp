#include "kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace meshtune {

void attention(const float* q, const float* k, const float* v, const uint8_t* key_valid, const AttentionShape& s,
               float* out) {
  const int64_t B = s.batch, T = s.query_len, S = s.capacity, N = s.heads, K = s.kv_heads, H = s.head_dim;
  const int64_t group = N / K;
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
          float max_score = -INFINITY;
          for (int64_t j = first; j <= last; ++j) {
            if (!key_valid[b * S + j]) { scores[j] = -INFINITY; continue; }
            const float* kj = k + ((b * S + j) * K + kv) * H;
            float dot = 0;
#pragma omp simd reduction(+ : dot)
            for (int64_t h = 0; h < H; ++h) dot += qv[h] * kj[h];
            if (s.soft_cap > 0) dot = std::tanh(dot / s.soft_cap) * s.soft_cap;
            scores[j] = dot;
            max_score = std::max(max_score, dot);
          }
          std::fill(o, o + H, 0.f);
          if (max_score == -INFINITY) continue;  // no allowed key: the row stays zero
          float sum = 0;
          for (int64_t j = first; j <= last; ++j) {
            float e = scores[j] == -INFINITY ? 0.f : std::exp(scores[j] - max_score);
            scores[j] = e;
            sum += e;
          }
          const float inv = 1.f / sum;
          for (int64_t j = first; j <= last; ++j) {
            if (scores[j] == 0.f) continue;
            const float p = scores[j] * inv;
            const float* vj = v + ((b * S + j) * K + kv) * H;
#pragma omp simd
            for (int64_t h = 0; h < H; ++h) o[h] += p * vj[h];
          }
        }
  }
}

}  // namespace meshtune
