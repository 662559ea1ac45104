#include "backend/reference_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/weight_matrix.h"

namespace meshtune {

void* ReferenceBackend::allocate_impl(size_t bytes) {
  void* p = allocate_host(bytes);
  // As a device stand-in: new memory holds NaNs (all bits set), not the host's zeros, so code that
  // relies on fresh buffers being zero fails here at once instead of now and then on a GPU.
  if (memory_ != Device::Host) std::memset(p, 0xff, bytes);
  return p;
}
void ReferenceBackend::release_impl(void* p) { free_host(p); }
void ReferenceBackend::upload_impl(const void* host, size_t bytes, void* device) {
  if (bytes > 0) std::memcpy(device, host, bytes);
}
void ReferenceBackend::download_impl(const void* device, size_t bytes, void* host) {
  if (bytes > 0) std::memcpy(host, device, bytes);
}

// ---- matrices ----

// What a matmul input holds under `precision`: the value rounded to bf16 for BF16 (not for int8,
// which keeps its own arithmetic).
static double matmul_input(float v, MatmulPrecision precision) {
  return precision == MatmulPrecision::BF16 ? double(round_to_bf16(v)) : double(v);
}

void ReferenceBackend::linear_impl(const float* x, int64_t M, const WeightMatrix& W, float* y,
                                   MatmulPrecision precision, const float* x_row_max) {
  if (W.dtype == DType::I8) {  // Keras' int8: x quantized per row, exact integer sums, one division
    std::vector<int8_t> codes(size_t(W.cols));
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * W.cols;
      float row_max = 0;
      for (int64_t c = 0; c < W.cols; ++c) row_max = std::max(row_max, std::fabs(xm[c]));
      const float sx = int8_scale(x_row_max ? x_row_max[m] : row_max);
      quantize_int8_scaled(xm, W.cols, sx, codes.data());
      for (int64_t r = 0; r < W.rows; ++r) {
        int64_t acc = 0;
        for (int64_t c = 0; c < W.cols; ++c) acc += int64_t(codes[size_t(c)]) * int64_t(W.i8()[r * W.cols + c]);
        y[m * W.rows + r] = float(acc) / (sx * W.scales[r]);
      }
    }
    return;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < W.rows; ++r) {
      double acc = 0;
      for (int64_t c = 0; c < W.cols; ++c)
        acc += matmul_input(x[m * W.cols + c], precision) * matmul_input(W.at(r, c), precision);
      y[m * W.rows + r] = float(acc);
    }
}

void ReferenceBackend::linear_backward_input_impl(const float* dy, int64_t M, const WeightMatrix& W, float* dx,
                                                  bool accumulate, MatmulPrecision precision) {
  if (W.dtype == DType::I8) precision = MatmulPrecision::F32;  // through the dequantized values
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < W.cols; ++c) {
      double acc = 0;
      for (int64_t r = 0; r < W.rows; ++r)
        acc += matmul_input(dy[m * W.rows + r], precision) * matmul_input(W.at(r, c), precision);
      float& out = dx[m * W.cols + c];
      out = accumulate ? float(double(out) + acc) : float(acc);
    }
}

void ReferenceBackend::linear_backward_weight_impl(const float* dy, const float* x, int64_t M, int64_t rows,
                                                   int64_t cols, float* dW) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      double acc = 0;
      for (int64_t m = 0; m < M; ++m) acc += double(dy[m * rows + r]) * x[m * cols + c];
      dW[r * cols + c] = float(double(dW[r * cols + c]) + acc);
    }
}

// A_g(i, j) and B(j, o) of a low-rank term, through its strides.
static double lora_a(const LowRankTerm& t, int64_t g, int64_t i, int64_t j) {
  return t.a[g * t.a_group + i * t.a_row + j * t.a_col];
}
static double lora_b(const LowRankTerm& t, int64_t j, int64_t o) { return t.b[j * t.b_row + o * t.b_col]; }

void ReferenceBackend::low_rank_impl(const float* x, int64_t M, const LowRankTerm& t, float* y) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < t.groups; ++g)
      for (int64_t o = 0; o < t.out_per_group; ++o) {
        double acc = 0;
        for (int64_t j = 0; j < t.rank; ++j) {
          double u = 0;
          for (int64_t i = 0; i < t.in; ++i) u += double(x[m * t.in + i]) * lora_a(t, g, i, j);
          acc += u * lora_b(t, j, o);
        }
        y[m * t.out() + g * t.out_per_group + o] += float(t.scale * acc);
      }
}

void ReferenceBackend::low_rank_backward_impl(const float* x, const float* dy, int64_t M, const LowRankTerm& t,
                                              float* dx) {
  const int64_t r = t.rank, out = t.out(), og = t.out_per_group;
  for (int64_t g = 0; g < t.groups; ++g)
    for (int64_t m = 0; m < M; ++m) {
      std::vector<double> u(size_t(r), 0.0), v(size_t(r), 0.0);  // x·A_g and dy_g·Bᵀ
      for (int64_t j = 0; j < r; ++j) {
        if (x)
          for (int64_t i = 0; i < t.in; ++i) u[size_t(j)] += double(x[m * t.in + i]) * lora_a(t, g, i, j);
        for (int64_t o = 0; o < og; ++o) v[size_t(j)] += double(dy[m * out + g * og + o]) * lora_b(t, j, o);
      }
      for (int64_t j = 0; j < r; ++j) {
        for (int64_t i = 0; i < t.in; ++i) {
          if (dx) dx[m * t.in + i] += float(t.scale * v[size_t(j)] * lora_a(t, g, i, j));
          if (t.grad_a)
            t.grad_a[g * t.a_group + i * t.a_row + j * t.a_col] += float(t.scale * double(x[m * t.in + i]) * v[size_t(j)]);
        }
        if (t.grad_b)
          for (int64_t o = 0; o < og; ++o)
            t.grad_b[j * t.b_row + o * t.b_col] += float(t.scale * u[size_t(j)] * double(dy[m * out + g * og + o]));
      }
    }
}

void ReferenceBackend::row_abs_max_impl(const float* x, int64_t rows, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float m = 0;
    for (int64_t c = 0; c < cols; ++c) m = std::max(m, std::fabs(x[r * cols + c]));
    out[r] = m;
  }
}

// ---- normalization, position, attention, activations ----

// 1 / √(mean(x²) + eps) of one row.
static double inverse_rms(const float* x, int64_t dim, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < dim; ++i) ss += double(x[i]) * x[i];
  return 1.0 / std::sqrt(ss / double(dim) + double(eps));
}

void ReferenceBackend::rmsnorm_impl(const float* x, const float* scale, int64_t rows, int64_t dim, float eps,
                                    float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const double inv = inverse_rms(x + r * dim, dim, eps);
    for (int64_t i = 0; i < dim; ++i) y[r * dim + i] = float(double(x[r * dim + i]) * inv * (1.0 + scale[i]));
  }
}

void ReferenceBackend::rmsnorm_backward_impl(const float* x, const float* scale, int64_t rows, int64_t dim, float eps,
                                             const float* dy, float* dx, float* dscale, bool accumulate) {
  // n = x·inv, y = n·(1 + s): ∂s += Σ dy·n; dn = dy·(1 + s); dx = inv·(dn − n·mean(dn·n)).
  std::vector<double> dn(static_cast<size_t>(dim));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    const double inv = inverse_rms(xr, dim, eps);
    double dot = 0;
    for (int64_t i = 0; i < dim; ++i) {
      const double n = double(xr[i]) * inv;
      dn[size_t(i)] = double(dy[r * dim + i]) * (1.0 + scale[i]);
      dot += dn[size_t(i)] * n;
      if (dscale) dscale[i] += float(double(dy[r * dim + i]) * n);
    }
    for (int64_t i = 0; i < dim; ++i) {
      const float value = float(inv * (dn[size_t(i)] - double(xr[i]) * inv * dot / double(dim)));
      dx[r * dim + i] = accumulate ? dx[r * dim + i] + value : value;
    }
  }
}

// Rotates each head's halves [x1 | x2] by θ = position·base^(−2i/H)/scaling (by −θ for backward).
static void rotate_halves(float* x, int64_t tokens, int64_t heads, int64_t head_dim, const int64_t* positions,
                          float base, float scaling, double sign) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = double(positions[t]) * std::pow(double(base), -double(2 * i) / double(head_dim)) / scaling;
      const double c = std::cos(angle), s = sign * std::sin(angle);
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x + (t * heads + h) * head_dim;
        const double x1 = v[i], x2 = v[i + half];
        v[i] = float(x1 * c - x2 * s);
        v[i + half] = float(x2 * c + x1 * s);
      }
    }
}

void ReferenceBackend::rope_impl(float* q, int64_t q_heads, float* k, int64_t k_heads, int64_t tokens,
                                 int64_t head_dim, const int64_t* positions, float base, float scaling, float q_scale,
                                 const CacheWrite* cache) {
  rotate_halves(q, tokens, q_heads, head_dim, positions, base, scaling, 1.0);
  rotate_halves(k, tokens, k_heads, head_dim, positions, base, scaling, 1.0);
  scale_impl(q, tokens * q_heads * head_dim, q_scale);
  if (!cache) return;
  // Token m = b·T + t goes to cache row b·capacity + start + t.
  const int64_t T = tokens / cache->batch, width = k_heads * head_dim;
  for (int64_t m = 0; m < tokens; ++m) {
    const int64_t row = (m / T) * cache->capacity + cache->start + m % T;
    for (int64_t w = 0; w < width; ++w) {
      cache->key_cache.data[row * width + w] = k[m * width + w];
      cache->value_cache.data[row * width + w] = cache->values.data[m * width + w];
    }
  }
}

void ReferenceBackend::rope_backward_impl(float* dq, int64_t q_heads, float* dk, int64_t k_heads, int64_t tokens,
                                          int64_t head_dim, const int64_t* positions, float base, float scaling,
                                          float q_scale) {
  scale_impl(dq, tokens * q_heads * head_dim, q_scale);
  rotate_halves(dq, tokens, q_heads, head_dim, positions, base, scaling, -1.0);
  rotate_halves(dk, tokens, k_heads, head_dim, positions, base, scaling, -1.0);
}

namespace {

// The attention probabilities of one query (row b, query t, head n) over the S key slots, and the
// capped scores: key j is allowed iff it is at or before the query's position, a real token, and
// inside the window; no allowed key leaves all p = 0.
struct QueryProbabilities {
  std::vector<double> p, capped;
};

// A product's input as the shape's precision has it: bf16-rounded under bf16_products; otherwise
// the value itself (fp32 inputs as they are, the probabilities and score gradients still double).
double operand(const AttentionShape& s, double x) { return s.bf16_products ? s.product_input(float(x)) : x; }

QueryProbabilities probabilities(const float* q, const float* k, const uint8_t* key_valid, const AttentionShape& s,
                                 int64_t b, int64_t t, int64_t n) {
  const int64_t S = s.capacity, K = s.kv_heads, H = s.head_dim, kv = n / (s.heads / K), pos = s.start + t;
  QueryProbabilities out{std::vector<double>(size_t(S), 0.0), std::vector<double>(size_t(S), 0.0)};
  std::vector<bool> allowed(size_t(S), false);
  double max = -INFINITY;
  const float* qv = q + ((b * s.query_len + t) * s.heads + n) * H;
  for (int64_t j = 0; j < S; ++j) {
    allowed[size_t(j)] = j <= pos && key_valid[b * S + j] && (s.window == 0 || pos - s.window < j);
    if (!allowed[size_t(j)]) continue;
    double d = 0;
    for (int64_t h = 0; h < H; ++h) d += operand(s, qv[h]) * operand(s, k[((b * S + j) * K + kv) * H + h]);
    if (s.soft_cap > 0) d = std::tanh(d / s.soft_cap) * s.soft_cap;
    out.capped[size_t(j)] = d;
    max = std::max(max, d);
  }
  double sum = 0;
  for (int64_t j = 0; j < S; ++j) sum += allowed[size_t(j)] ? std::exp(out.capped[size_t(j)] - max) : 0.0;
  for (int64_t j = 0; j < S; ++j)
    if (allowed[size_t(j)]) out.p[size_t(j)] = operand(s, std::exp(out.capped[size_t(j)] - max) / sum);
  return out;
}

}  // namespace

void ReferenceBackend::attention_impl(const float* q, const float* k, const float* v, const uint8_t* key_valid,
                                      const AttentionShape& s, float* out) {
  const int64_t S = s.capacity, K = s.kv_heads, H = s.head_dim;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < s.query_len; ++t)
      for (int64_t n = 0; n < s.heads; ++n) {
        const QueryProbabilities a = probabilities(q, k, key_valid, s, b, t, n);
        const int64_t kv = n / (s.heads / K);
        for (int64_t h = 0; h < H; ++h) {
          double acc = 0;
          for (int64_t j = 0; j < S; ++j)  // keys not attended to are skipped: their slots may hold anything
            if (a.p[size_t(j)] != 0) acc += a.p[size_t(j)] * operand(s, v[((b * S + j) * K + kv) * H + h]);
          out[((b * s.query_len + t) * s.heads + n) * H + h] = float(acc);
        }
      }
}

void ReferenceBackend::attention_backward_impl(const float* q, const float* k, const float* v,
                                               const uint8_t* key_valid, const AttentionShape& s, const float* dout,
                                               float* dq, float* dk, float* dv) {
  const int64_t S = s.capacity, K = s.kv_heads, H = s.head_dim, T = s.query_len;
  std::vector<double> gq(size_t(s.batch * T * s.heads * H), 0.0), gk(size_t(s.batch * S * K * H), 0.0),
      gv(gk.size(), 0.0);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < s.heads; ++n) {
        const QueryProbabilities a = probabilities(q, k, key_valid, s, b, t, n);
        const int64_t kv = n / (s.heads / K), qi = ((b * T + t) * s.heads + n) * H;
        // dp_j = dout·v_j; ds_j = p_j·(dp_j − Σ p·dp), times the cap's slope 1 − (capped/cap)².
        std::vector<double> dp(size_t(S), 0.0);
        double p_dot_dp = 0;
        for (int64_t j = 0; j < S; ++j) {
          if (a.p[size_t(j)] == 0) continue;
          for (int64_t h = 0; h < H; ++h) dp[size_t(j)] += operand(s, dout[qi + h]) * operand(s, v[((b * S + j) * K + kv) * H + h]);
          p_dot_dp += a.p[size_t(j)] * dp[size_t(j)];
        }
        for (int64_t j = 0; j < S; ++j) {
          if (a.p[size_t(j)] == 0) continue;
          double ds = a.p[size_t(j)] * (dp[size_t(j)] - p_dot_dp);
          if (s.soft_cap > 0) ds *= 1.0 - (a.capped[size_t(j)] / s.soft_cap) * (a.capped[size_t(j)] / s.soft_cap);
          ds = operand(s, ds);
          const int64_t ki = ((b * S + j) * K + kv) * H;
          for (int64_t h = 0; h < H; ++h) {
            gq[size_t(qi + h)] += ds * operand(s, k[ki + h]);
            gk[size_t(ki + h)] += ds * operand(s, q[qi + h]);
            gv[size_t(ki + h)] += a.p[size_t(j)] * operand(s, dout[qi + h]);
          }
        }
      }
  for (size_t i = 0; i < gq.size(); ++i) dq[i] = float(gq[i]);
  for (size_t i = 0; i < gk.size(); ++i) dk[i] = float(gk[i]), dv[i] = float(gv[i]);
}

// gelu_tanh(u) = 0.5·u·(1 + tanh a), a = √(2/π)·(u + 0.044715·u³), and its derivative.
static double gelu(double u) {
  return 0.5 * u * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (u + 0.044715 * u * u * u)));
}
static double gelu_slope(double u) {
  const double a = std::sqrt(2.0 / M_PI) * (u + 0.044715 * u * u * u), th = std::tanh(a);
  return 0.5 * (1.0 + th) + 0.5 * u * (1.0 - th * th) * std::sqrt(2.0 / M_PI) * (1.0 + 3.0 * 0.044715 * u * u);
}

void ReferenceBackend::geglu_impl(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = float(gelu(gate[i]) * up[i]);
}

void ReferenceBackend::geglu_backward_impl(const float* gate, const float* up, const float* dout, int64_t n,
                                           float* dgate, float* dup) {
  for (int64_t i = 0; i < n; ++i) {
    const double u = gate[i], g = double(dout[i]);
    const double d_gate = g * up[i] * gelu_slope(u), d_up = g * gelu(u);
    dgate[i] = float(d_gate);
    dup[i] = float(d_up);
  }
}

void ReferenceBackend::soft_cap_impl(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = float(double(cap) * std::tanh(double(x[i]) / cap));
}

void ReferenceBackend::soft_cap_backward_impl(const float* y, float* dy, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) dy[i] = float(double(dy[i]) * (1.0 - (double(y[i]) / cap) * (double(y[i]) / cap)));
}

// ---- the chunked softmax cross-entropy ----

void ReferenceBackend::softmax_row_max_impl(const float* z, int64_t n, int64_t cols, int64_t v0,
                                            float* max_and_argmax) {
  for (int64_t i = 0; i < n; ++i) {
    int64_t best = 0;
    for (int64_t c = 1; c < cols; ++c)
      if (z[i * cols + c] > z[i * cols + best]) best = c;
    max_and_argmax[i] = z[i * cols + best];
    max_and_argmax[n + i] = float(v0 + best);
  }
}

void ReferenceBackend::softmax_combine_max_impl(const float* gathered, int parts, int64_t n, float* max_and_argmax) {
  softmax_combine_max_rows(gathered, parts, n, max_and_argmax);
}

void ReferenceBackend::softmax_row_sums_impl(const float* z, int64_t n, int64_t cols, int64_t v0,
                                             const int32_t* targets, const float* max_and_argmax,
                                             double* sum_exp_and_target) {
  for (int64_t i = 0; i < n; ++i) {
    double sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += std::exp(double(z[i * cols + c]) - max_and_argmax[i]);
    const int64_t y = targets[i] - v0;
    sum_exp_and_target[i] = sum;
    sum_exp_and_target[n + i] = y >= 0 && y < cols ? double(z[i * cols + y]) : 0.0;
  }
}

void ReferenceBackend::softmax_cross_entropy_sums_impl(const float* max_and_argmax, const double* sum_exp_and_target,
                                                       const int32_t* targets, const float* weights, int64_t n,
                                                       double* sums) {
  softmax_cross_entropy_sum_rows(max_and_argmax, sum_exp_and_target, targets, weights, n, sums);
}

void ReferenceBackend::softmax_cross_entropy_backward_impl(float* z, int64_t n, int64_t cols, int64_t v0,
                                                           const int32_t* targets, const float* weights,
                                                           double loss_scale, const float* max_and_argmax,
                                                           const double* sum_exp_and_target, float cap) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t y = targets[i] - v0;
    const double factor = loss_scale * weights[i];
    for (int64_t c = 0; c < cols; ++c) {
      const double zc = z[i * cols + c];
      double g = std::exp(zc - max_and_argmax[i]) / sum_exp_and_target[i] - (c == y ? 1.0 : 0.0);
      if (cap > 0) g *= 1.0 - (zc / cap) * (zc / cap);
      z[i * cols + c] = float(factor * g);
    }
  }
}

// ---- data movement ----

void ReferenceBackend::embedding_lookup_impl(const WeightMatrix& table, int64_t first_row, const int32_t* ids,
                                             int64_t M, float factor, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = int64_t(ids[m]) - first_row;
    for (int64_t c = 0; c < table.cols; ++c)
      out[m * table.cols + c] = r >= 0 && r < table.rows ? table.at(r, c) * factor : 0.f;
  }
}

void ReferenceBackend::embedding_lookup_backward_impl(const float* dy, const int32_t* ids, int64_t M, int64_t dim,
                                                      int64_t first_row, int64_t rows, float factor, float* grad) {
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = int64_t(ids[m]) - first_row;
    if (r < 0 || r >= rows) continue;
    for (int64_t c = 0; c < dim; ++c) grad[r * dim + c] += factor * dy[m * dim + c];
  }
}

void ReferenceBackend::gather_rows_impl(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < dim; ++c) dst[i * dim + c] = src[rows[i] * dim + c];
}

void ReferenceBackend::greedy_tokens_impl(const float* max_and_argmax, int64_t rows, const uint8_t* keep, int32_t* ids) {
  greedy_token_rows(max_and_argmax, rows, keep, ids);
}
void ReferenceBackend::scatter_rows_impl(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < dim; ++c) dst[rows[i] * dim + c] = src[i * dim + c];
}

void ReferenceBackend::interleave_column_blocks_impl(const float* blocks, int parts, int64_t M, int64_t part,
                                                     float* out) {
  for (int r = 0; r < parts; ++r)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < part; ++c) out[(m * parts + r) * part + c] = blocks[(r * M + m) * part + c];
}

void ReferenceBackend::copy_impl(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }
void ReferenceBackend::zero_impl(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = 0.f;
}
void ReferenceBackend::add_into_impl(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}
void ReferenceBackend::scale_impl(float* x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}
void ReferenceBackend::narrow_to_bf16_impl(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}
void ReferenceBackend::widen_bf16_impl(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

// ---- optimizer: Keras' AdamW, each operation rounded to fp32 in Keras' order ----

void ReferenceBackend::adamw_update_impl(float* theta, const float* grad, float* m, float* v, int64_t n,
                                         const AdamWStep& step) {
  for (int64_t i = 0; i < n; ++i) adamw_update_one(theta[i], grad[i], m[i], v[i], step);
}

double ReferenceBackend::sum_of_squares_impl(const float* x, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * double(x[i]);
  return sum;
}
void ReferenceBackend::scale_by_ratio_impl(float* x, int64_t n, float numerator, float denominator) {
  for (int64_t i = 0; i < n; ++i) x[i] = (x[i] * numerator) / denominator;
}
void ReferenceBackend::clamp_impl(float* x, int64_t n, float limit) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::clamp(x[i], -limit, limit);
}
int64_t ReferenceBackend::first_not_finite_impl(const std::vector<ConstFloats>& arrays) {
  for (size_t a = 0; a < arrays.size(); ++a)
    for (size_t i = 0; i < arrays[a].size; ++i)
      if (!std::isfinite(arrays[a].data[i])) return int64_t(a);
  return -1;
}

}  // namespace meshtune
