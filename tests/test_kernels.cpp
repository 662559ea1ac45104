// Each kernel against a plain reference loop written from the spec's formula, over odd sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/activation.h"
#include "kernels/attention.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "test_util.h"

using namespace meshtune;
using meshtune::testing::random_vector;

namespace {

TEST(Kernels, RmsNormMatchesFormula) {
  for (int64_t dim : {1, 7, 64, 129}) {
    const int64_t rows = 5;
    auto x = random_vector(size_t(rows * dim), 1), scale = random_vector(size_t(dim), 2, 0.3f);
    std::vector<float> y(x.size());
    rmsnorm(x.data(), scale.data(), rows, dim, 1e-6f, y.data());
    for (int64_t r = 0; r < rows; ++r) {
      double ms = 0;
      for (int64_t i = 0; i < dim; ++i) ms += double(x[r * dim + i]) * x[r * dim + i];
      double inv = 1 / std::sqrt(ms / dim + 1e-6);
      for (int64_t i = 0; i < dim; ++i) EXPECT_NEAR(y[r * dim + i], x[r * dim + i] * inv * (1 + scale[i]), 1e-5);
    }
  }
}

TEST(Kernels, RopeRotatesHalvesByPositionAngle) {
  const int64_t T = 4, heads = 3, H = 10;
  std::vector<int64_t> pos = {0, 1, 7, 1000};
  for (float scaling : {1.f, 8.f}) {
    auto x = random_vector(size_t(T * heads * H), 3), y = x;
    rope(y.data(), T, heads, H, pos.data(), 10000.f, scaling);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < H / 2; ++i) {
          double theta = double(pos[t]) * std::pow(10000.0, -2.0 * i / H) / scaling;
          const float* in = &x[(t * heads + h) * H];
          const float* out = &y[(t * heads + h) * H];
          EXPECT_NEAR(out[i], in[i] * std::cos(theta) - in[i + H / 2] * std::sin(theta), 2e-4);
          EXPECT_NEAR(out[i + H / 2], in[i + H / 2] * std::cos(theta) + in[i] * std::sin(theta), 2e-4);
        }
  }
}

TEST(Kernels, GegluAndSoftCap) {
  auto g = random_vector(37, 4, 2.f), u = random_vector(37, 5), out = g;
  geglu(out.data(), u.data(), 37);
  for (size_t i = 0; i < g.size(); ++i) {
    double v = g[i];
    double gelu = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    EXPECT_NEAR(out[i], gelu * u[i], 1e-5);
  }
  auto c = g;
  soft_cap(c.data(), 37, 1.5f);
  for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(c[i], std::tanh(g[i] / 1.5) * 1.5, 1e-6);
}

// Plain attention from the definition, in double.
void attention_reference(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                         const std::vector<uint8_t>& valid, const AttentionShape& s, std::vector<float>& out) {
  const int64_t G = s.heads / s.kv_heads;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < s.query_len; ++t)
      for (int64_t n = 0; n < s.heads; ++n) {
        const int64_t p = s.start + t, kv = n / G;
        std::vector<double> score(size_t(s.capacity), 0);
        std::vector<bool> allowed(size_t(s.capacity), false);
        double mx = -1e300;
        for (int64_t j = 0; j < s.capacity; ++j) {
          allowed[j] = j <= p && valid[b * s.capacity + j] && (s.window == 0 || p - j < s.window);
          if (!allowed[j]) continue;
          double d = 0;
          for (int64_t h = 0; h < s.head_dim; ++h)
            d += double(q[((b * s.query_len + t) * s.heads + n) * s.head_dim + h]) * k[((b * s.capacity + j) * s.kv_heads + kv) * s.head_dim + h];
          if (s.soft_cap > 0) d = std::tanh(d / s.soft_cap) * s.soft_cap;
          score[j] = d;
          mx = std::max(mx, d);
        }
        double sum = 0;
        for (int64_t j = 0; j < s.capacity; ++j) sum += allowed[j] ? std::exp(score[j] - mx) : 0;
        for (int64_t h = 0; h < s.head_dim; ++h) {
          double acc = 0;
          for (int64_t j = 0; j < s.capacity; ++j)
            if (allowed[j]) acc += std::exp(score[j] - mx) / sum * v[((b * s.capacity + j) * s.kv_heads + kv) * s.head_dim + h];
          out[((b * s.query_len + t) * s.heads + n) * s.head_dim + h] = sum > 0 ? float(acc) : 0.f;
        }
      }
}

TEST(Kernels, AttentionMatchesDefinition) {
  struct Case { int64_t B, T, start, S, N, K, H, W; float cap; };
  for (Case c : {Case{2, 5, 0, 5, 4, 1, 16, 0, 0}, Case{1, 3, 4, 9, 4, 2, 8, 3, 0}, Case{3, 1, 6, 7, 6, 3, 5, 0, 1.5f},
                 Case{2, 7, 0, 7, 2, 2, 32, 4, 50.f}}) {
    AttentionShape s{c.B, c.T, c.start, c.S, c.N, c.K, c.H, c.W, c.cap};
    auto q = random_vector(size_t(c.B * c.T * c.N * c.H), 6), k = random_vector(size_t(c.B * c.S * c.K * c.H), 7),
         v = random_vector(size_t(c.B * c.S * c.K * c.H), 8);
    std::vector<uint8_t> valid(size_t(c.B * c.S), 1);
    valid[size_t(c.S - 1)] = 0;  // one padding key in row 0
    if (c.B > 1) valid[size_t(c.S)] = 0;  // row 1's first key is padding: its position-0 query sees nothing
    std::vector<float> got(q.size()), expected(q.size());
    attention(q.data(), k.data(), v.data(), valid.data(), s, got.data());
    attention_reference(q, k, v, valid, s, expected);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], expected[i], 1e-5) << i;
  }
}

}  // namespace
