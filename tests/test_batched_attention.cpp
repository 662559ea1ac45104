// The CUDA backend's second attention route (MESHTUNE_CUDA_ATTENTION=gemm) as host code: the
// strided-batched products backend/batched_attention.h describes, run here with plain column-major
// loops (as cuBLAS defines them), and the softmax rows between them written from the same formulas
// as the route's kernels, must compute the reference backend's attention and its gradients. What
// this checks on a machine without a GPU is the index arithmetic — offsets, leading dimensions,
// batch strides, head groups, the key slots used; the GPU test runs the route itself
// (scripts/device-check: the registry's attention cases under MESHTUNE_CUDA_ATTENTION=gemm).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend/batched_attention.h"
#include "backend/reference_backend.h"
#include "test_util.h"

namespace meshtune {
namespace {

using testing::random_vector;
using Values = std::vector<float>;

// C = op(A)·op(B) + beta·C, column-major, summed in double; beta 0 never reads C (as cuBLAS).
void run_on_host(const std::vector<BatchedProduct>& products, const Values& A, const Values& B, Values& C) {
  for (const BatchedProduct& p : products)
    for (int64_t i = 0; i < p.batch; ++i) {
      const float* a = A.data() + p.a + i * p.stride_a;
      const float* b = B.data() + p.b + i * p.stride_b;
      float* c = C.data() + p.c + i * p.stride_c;
      for (int64_t col = 0; col < p.n; ++col)
        for (int64_t row = 0; row < p.m; ++row) {
          double acc = 0;
          for (int64_t x = 0; x < p.k; ++x)
            acc += double(p.transpose_a ? a[x + row * p.lda] : a[row + x * p.lda]) *
                   (p.transpose_b ? b[col + x * p.ldb] : b[x + col * p.ldb]);
          float& out = c[row + col * p.ldc];
          out = float(p.beta == 0 ? acc : acc + double(p.beta) * out);
        }
    }
}

bool allowed(const AttentionShape& s, const std::vector<uint8_t>& valid, int64_t b, int64_t t, int64_t j) {
  const int64_t pos = s.start + t;
  return j <= pos && valid[size_t(b * s.capacity + j)] && (s.window == 0 || pos - s.window < j);
}

// Score rows [B, N, T, L] → probabilities (0 where not allowed); capped scores into `capped`.
void softmax_rows(const AttentionShape& s, const std::vector<uint8_t>& valid, Values& scores, Values& capped) {
  const int64_t L = attention_key_slots(s);
  for (int64_t row = 0; row < s.batch * s.heads * s.query_len; ++row) {
    const int64_t t = row % s.query_len, b = row / (s.query_len * s.heads);
    float* x = scores.data() + row * L;
    float max = -INFINITY;
    for (int64_t j = 0; j < L; ++j) {
      if (!allowed(s, valid, b, t, j)) continue;
      double d = x[j];
      if (s.soft_cap > 0) d = std::tanh(d / s.soft_cap) * s.soft_cap;
      x[j] = float(d);
      max = std::fmax(max, x[j]);
    }
    double sum = 0;
    for (int64_t j = 0; j < L; ++j) {
      const bool ok = allowed(s, valid, b, t, j);
      capped[size_t(row * L + j)] = ok ? x[j] : 0.f;
      const double e = ok ? std::exp(double(x[j]) - max) : 0.0;
      x[j] = float(e);
      sum += e;
    }
    for (int64_t j = 0; j < L; ++j) x[j] = sum > 0 && allowed(s, valid, b, t, j) ? float(double(x[j]) / sum) : 0.f;
  }
}

// dp rows → ds = p·(dp − Σ p·dp)·(1 − (capped/cap)²).
void softmax_backward_rows(const AttentionShape& s, const Values& probs, const Values& capped, Values& d) {
  const int64_t L = attention_key_slots(s);
  for (int64_t row = 0; row < s.batch * s.heads * s.query_len; ++row) {
    const float* p = probs.data() + row * L;
    float* x = d.data() + row * L;
    double p_dot_dp = 0;
    for (int64_t j = 0; j < L; ++j)
      if (p[j] != 0) p_dot_dp += double(p[j]) * x[j];
    for (int64_t j = 0; j < L; ++j) {
      double ds = p[j] != 0 ? double(p[j]) * (double(x[j]) - p_dot_dp) : 0.0;
      if (p[j] != 0 && s.soft_cap > 0) {
        const double c = capped[size_t(row * L + j)] / s.soft_cap;
        ds *= 1.0 - c * c;
      }
      x[j] = float(ds);
    }
  }
}

void expect_close(const Values& got, const Values& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 2e-6 * std::fmax(1.f, std::fabs(want[i]))) << what << "[" << i << "]";
}

struct Case {
  const char* name;
  AttentionShape s;  // {batch, query_len, start, capacity, heads, kv_heads, head_dim, window, soft_cap}
  std::vector<int64_t> padding;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class BatchedAttention : public ::testing::TestWithParam<Case> {};

TEST_P(BatchedAttention, ProductsComputeTheReferenceAttention) {
  const AttentionShape s = GetParam().s;
  const int64_t Q = s.batch * s.query_len * s.heads * s.head_dim, KV = s.batch * s.capacity * s.kv_heads * s.head_dim;
  const int64_t L = attention_key_slots(s), rows = s.batch * s.heads * s.query_len;
  std::vector<uint8_t> valid(size_t(s.batch * s.capacity), 1);
  for (int64_t p : GetParam().padding) valid[size_t(p)] = 0;
  const Values q = random_vector(size_t(Q), 21), dout = random_vector(size_t(Q), 22);
  Values k = random_vector(size_t(KV), 23), v = random_vector(size_t(KV), 24);
  // Cache slots past the last query's position may hold anything: NaN there must not reach any output.
  const int64_t written = s.start + s.query_len;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t j = written; j < s.capacity; ++j)
      for (int64_t e = 0; e < s.kv_heads * s.head_dim; ++e)
        k[size_t((b * s.capacity + j) * s.kv_heads * s.head_dim + e)] =
            v[size_t((b * s.capacity + j) * s.kv_heads * s.head_dim + e)] = NAN;

  ReferenceBackend reference;
  const size_t nq = size_t(Q), nkv = size_t(KV);
  Values want(nq), want_dq(nq), want_dk(nkv), want_dv(nkv);
  reference.attention(q, k, v, valid, s, want);
  reference.attention_backward(q, k, v, valid, s, dout, want_dq, want_dk, want_dv);

  // Every output is written by the products (NaN-filled first), and slots past L are never read.
  Values probs(size_t(rows * L), NAN), capped(size_t(rows * L)), out(size_t(Q), NAN);
  run_on_host(attention_score_products(s), k, q, probs);
  softmax_rows(s, valid, probs, capped);
  run_on_host(attention_sum_products(s), v, probs, out);
  expect_close(out, want, "out");

  // The key gradients' slots below L too; the caller zeroes the rest (the products never write it).
  const float unwritten = L < s.capacity ? 0.f : NAN;
  Values dscores(size_t(rows * L), NAN), dq(size_t(Q), NAN), dk(size_t(KV), unwritten), dv(size_t(KV), unwritten);
  run_on_host(attention_score_products(s), v, dout, dscores);
  softmax_backward_rows(s, probs, capped, dscores);
  run_on_host(attention_sum_products(s), k, dscores, dq);
  run_on_host(attention_key_gradient_products(s), q, dscores, dk);
  run_on_host(attention_key_gradient_products(s), dout, probs, dv);
  expect_close(dq, want_dq, "dq");
  expect_close(dk, want_dk, "dk");
  expect_close(dv, want_dv, "dv");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BatchedAttention,
    ::testing::Values(Case{"gqa_padding", {2, 7, 0, 7, 4, 2, 5, 0, 0.f}, {0, 7 + 4}},
                      Case{"mqa_window_cap", {1, 9, 0, 9, 4, 1, 3, 2, 1.5f}, {3}},
                      Case{"mha_window3", {2, 6, 0, 6, 3, 3, 7, 3, 30.f}, {6 + 5}},
                      Case{"gqa8_to_2", {3, 5, 0, 5, 8, 2, 4, 0, 0.f}, {2, 5 + 0}},
                      Case{"decode", {2, 1, 5, 8, 4, 2, 8, 0, 0.f}, {3}},
                      Case{"prefill_at_2", {1, 4, 2, 9, 2, 1, 16, 3, 0.f}, {}},
                      Case{"cache_longer_than_used", {2, 3, 0, 11, 6, 3, 4, 0, 50.f}, {}}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace meshtune
