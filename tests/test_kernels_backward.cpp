// Backward kernels against central finite differences of L = Σ c_i·y_i (random c, so dy = c).
// The elementwise kernels and rmsnorm are differenced through the fp32 forward itself, with an
// fp32-honest tolerance; attention is differenced through a plain fp64 reference forward, so its
// analytic gradient can be held to ~1e-4.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "kernels/activation.h"
#include "kernels/attention.h"
#include "kernels/cross_entropy.h"
#include "kernels/low_rank.h"
#include "kernels/rmsnorm.h"
#include "kernels/rope.h"
#include "test_util.h"

using namespace meshtune;
using meshtune::testing::random_vector;

namespace {

double weighted_sum(const std::vector<float>& c, const std::vector<float>& y) {
  double L = 0;
  for (size_t i = 0; i < y.size(); ++i) L += double(c[i]) * y[i];
  return L;
}

// Central differences of loss() in every element of x (which loss reads by reference), compared
// with `analytic`: asserts |fd − analytic| ≤ tol·max(1, |analytic|) and returns the largest
// such relative error. The step actually taken in fp32 is used as the denominator.
double check_fp32_gradient(std::vector<float>& x, const std::vector<float>& analytic,
                           const std::function<double()>& loss, float h, double tol, const char* what) {
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float orig = x[i];
    const float xp = orig + h, xm = orig - h;
    x[i] = xp;
    const double lp = loss();
    x[i] = xm;
    const double lm = loss();
    x[i] = orig;
    const double fd = (lp - lm) / (double(xp) - double(xm));
    const double err = std::abs(fd - analytic[i]) / std::max(1.0, std::abs(double(analytic[i])));
    worst = std::max(worst, err);
    EXPECT_LE(err, tol) << what << "[" << i << "]: fd " << fd << " analytic " << analytic[i];
  }
  return worst;
}

TEST(KernelsBackward, RmsNormMatchesFiniteDifferences) {
  double worst_x = 0, worst_scale = 0;
  for (int64_t dim : {1, 7, 33}) {
    const int64_t rows = 3;
    const float eps = 1e-6f;
    auto x = random_vector(size_t(rows * dim), 11), scale = random_vector(size_t(dim), 12, 0.3f);
    auto c = random_vector(x.size(), 13);
    auto loss = [&] {
      std::vector<float> y(x.size());
      rmsnorm(x.data(), scale.data(), rows, dim, eps, y.data());
      return weighted_sum(c, y);
    };
    std::vector<float> dx(x.size());
    std::vector<float> dscale(size_t(dim), 0.5f);  // rmsnorm_backward adds into dscale
    rmsnorm_backward(x.data(), scale.data(), rows, dim, eps, c.data(), dx.data(), dscale.data());
    for (float& d : dscale) d -= 0.5f;
    worst_x = std::max(worst_x, check_fp32_gradient(x, dx, loss, 1e-2f, 2e-3, "rmsnorm dx"));
    worst_scale = std::max(worst_scale, check_fp32_gradient(scale, dscale, loss, 1e-2f, 2e-3, "rmsnorm dscale"));

    // dx may alias dy, and dscale may be null.
    std::vector<float> in_place = c;
    rmsnorm_backward(x.data(), scale.data(), rows, dim, eps, in_place.data(), in_place.data(), nullptr);
    for (size_t i = 0; i < dx.size(); ++i) EXPECT_EQ(in_place[i], dx[i]);
  }
  std::printf("rmsnorm: max rel err dx %.2e, dscale %.2e\n", worst_x, worst_scale);
}

TEST(KernelsBackward, RmsNormParallelPathMatchesSerial) {
  // Large enough to take the OpenMP path: dscale must still be the sum over all rows.
  const int64_t rows = 300, dim = 129;
  auto x = random_vector(size_t(rows * dim), 14), scale = random_vector(size_t(dim), 15, 0.3f);
  auto dy = random_vector(x.size(), 16);
  std::vector<float> dx(x.size()), dscale(size_t(dim), 0.f);
  rmsnorm_backward(x.data(), scale.data(), rows, dim, 1e-6f, dy.data(), dx.data(), dscale.data());
  std::vector<double> expected(size_t(dim), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t i = 0; i < dim; ++i) ms += double(x[r * dim + i]) * x[r * dim + i];
    const double inv = 1 / std::sqrt(ms / dim + 1e-6);
    for (int64_t i = 0; i < dim; ++i) expected[i] += double(dy[r * dim + i]) * x[r * dim + i] * inv;
  }
  for (int64_t i = 0; i < dim; ++i) EXPECT_NEAR(dscale[i], expected[i], 1e-3 * std::max(1.0, std::abs(expected[i])));
}

TEST(KernelsBackward, RopeMatchesFiniteDifferences) {
  const int64_t T = 3, heads = 2;
  std::vector<int64_t> pos = {0, 3, 17};
  double worst = 0;
  for (int64_t H : {2, 6, 8})
    for (float scaling : {1.f, 8.f}) {
      auto x = random_vector(size_t(T * heads * H), 21), c = random_vector(x.size(), 22);
      auto loss = [&] {
        std::vector<float> y = x;
        rope(y.data(), T, heads, H, pos.data(), 10000.f, scaling);
        return weighted_sum(c, y);
      };
      std::vector<float> dx = c;
      rope_backward(dx.data(), T, heads, H, pos.data(), 10000.f, scaling);
      worst = std::max(worst, check_fp32_gradient(x, dx, loss, 1e-2f, 2e-3, "rope dx"));
    }
  std::printf("rope: max rel err dx %.2e\n", worst);
}

TEST(KernelsBackward, RopeBackwardUndoesRope) {
  const int64_t T = 4, heads = 3, H = 16;
  std::vector<int64_t> pos = {0, 3, 17, 1000};
  double worst = 0;
  for (float scaling : {1.f, 8.f}) {
    auto x = random_vector(size_t(T * heads * H), 23), y = x;
    rope(y.data(), T, heads, H, pos.data(), 10000.f, scaling);
    rope_backward(y.data(), T, heads, H, pos.data(), 10000.f, scaling);
    for (size_t i = 0; i < x.size(); ++i) {
      worst = std::max(worst, double(std::abs(y[i] - x[i])));
      // Only fp32 rounding of the two rotations (cos² + sin² is 1 to within an ulp or so).
      EXPECT_NEAR(y[i], x[i], 1e-5f * std::max(1.f, std::abs(x[i]))) << i;
    }
    // Position 0 rotates by exactly 0: both directions leave it bit-identical.
    for (int64_t i = 0; i < heads * H; ++i) EXPECT_EQ(y[size_t(i)], x[size_t(i)]);
  }
  std::printf("rope round trip: max abs err %.2e\n", worst);
}

TEST(KernelsBackward, GegluMatchesFiniteDifferences) {
  auto gate = random_vector(37, 31, 2.f), up = random_vector(37, 32);
  // Also the tails, where tanh saturates, and zero.
  for (float u : {-6.f, -3.f, -1.f, 0.f, 0.5f, 3.f, 6.f}) {
    gate.push_back(u);
    up.push_back(0.7f);
  }
  const int64_t n = int64_t(gate.size());
  auto c = random_vector(gate.size(), 33);
  auto loss = [&] {
    std::vector<float> out = gate;
    geglu(out.data(), up.data(), n);
    return weighted_sum(c, out);
  };
  std::vector<float> dgate(gate.size()), dup(gate.size());
  geglu_backward(gate.data(), up.data(), c.data(), n, dgate.data(), dup.data());
  const double worst_gate = check_fp32_gradient(gate, dgate, loss, 1e-2f, 2e-3, "geglu dgate");
  const double worst_up = check_fp32_gradient(up, dup, loss, 1e-2f, 2e-3, "geglu dup");
  std::printf("geglu: max rel err dgate %.2e, dup %.2e\n", worst_gate, worst_up);
}

TEST(KernelsBackward, SoftCapMatchesFiniteDifferences) {
  double worst = 0;
  for (float cap : {1.5f, 30.f}) {
    auto x = random_vector(41, 41, 2.f), c = random_vector(41, 42);
    auto loss = [&] {
      std::vector<float> y = x;
      soft_cap(y.data(), int64_t(y.size()), cap);
      return weighted_sum(c, y);
    };
    std::vector<float> y = x, dx = c;
    soft_cap(y.data(), int64_t(y.size()), cap);
    soft_cap_backward(y.data(), dx.data(), int64_t(dx.size()), cap);
    worst = std::max(worst, check_fp32_gradient(x, dx, loss, 1e-2f, 2e-3, "soft_cap dx"));
  }
  std::printf("soft_cap: max rel err dx %.2e\n", worst);
}

// Plain attention from the definition, all in double (training case: start 0, S = T).
std::vector<double> attention_fp64(const std::vector<double>& q, const std::vector<double>& k,
                                   const std::vector<double>& v, const std::vector<uint8_t>& valid,
                                   const AttentionShape& s) {
  const int64_t T = s.query_len, N = s.heads, K = s.kv_heads, H = s.head_dim, G = N / K;
  std::vector<double> out(size_t(s.batch * T * N * H), 0.0);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        const int64_t kv = n / G;
        std::vector<double> score(size_t(T), 0.0);
        std::vector<bool> allowed(size_t(T), false);
        double mx = -1e300;
        for (int64_t j = 0; j < T; ++j) {
          allowed[j] = j <= t && valid[b * T + j] && (s.window == 0 || t - j < s.window);
          if (!allowed[j]) continue;
          double d = 0;
          for (int64_t h = 0; h < H; ++h) d += q[((b * T + t) * N + n) * H + h] * k[((b * T + j) * K + kv) * H + h];
          if (s.soft_cap > 0) d = std::tanh(d / s.soft_cap) * s.soft_cap;
          score[j] = d;
          mx = std::max(mx, d);
        }
        double sum = 0;
        for (int64_t j = 0; j < T; ++j) sum += allowed[j] ? std::exp(score[j] - mx) : 0.0;
        if (sum == 0) continue;  // no allowed key: zeros
        for (int64_t j = 0; j < T; ++j) {
          if (!allowed[j]) continue;
          const double p = std::exp(score[j] - mx) / sum;
          for (int64_t h = 0; h < H; ++h)
            out[((b * T + t) * N + n) * H + h] += p * v[((b * T + j) * K + kv) * H + h];
        }
      }
  return out;
}

std::vector<double> to_double(const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); }

// fp64 central differences of L = Σ c·attention_fp64(...) in every element of x, against analytic.
double check_fp64_gradient(std::vector<double>& x, const std::vector<float>& analytic,
                           const std::function<double()>& loss, double tol, const char* what) {
  const double h = 1e-5;
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double orig = x[i];
    x[i] = orig + h;
    const double lp = loss();
    x[i] = orig - h;
    const double lm = loss();
    x[i] = orig;
    const double fd = (lp - lm) / (2 * h);
    const double err = std::abs(fd - analytic[i]) / std::max(1.0, std::abs(double(analytic[i])));
    worst = std::max(worst, err);
    EXPECT_LE(err, tol) << what << "[" << i << "]: fd " << fd << " analytic " << analytic[i];
  }
  return worst;
}

TEST(KernelsBackward, AttentionMatchesFp64FiniteDifferences) {
  struct Case {
    int64_t B, T, N, K, H, W;
    float cap;
    std::vector<int64_t> padding;  // flat b·T + j indices of padding keys
    std::vector<int64_t> empty_rows;  // flat b·T + t query rows that see no key
  };
  const std::vector<Case> cases = {
      // GQA 4→2, no window or cap; row 0's first key is padding, so its query 0 sees nothing.
      {2, 7, 4, 2, 5, 0, 0.f, {0, 7 + 4}, {0}},
      // MQA 4→1, window 2, soft-cap 1.5; keys 3 and 4 padded, so query 4 (window {3, 4}) sees nothing.
      {1, 9, 4, 1, 3, 2, 1.5f, {3, 4}, {4}},
      // MQA, window 3, odd head_dim, a padding key at the end of row 1.
      {2, 6, 4, 1, 7, 3, 0.f, {6 + 5}, {}},
      // Plain multi-head (N = K = 3), soft-cap with a window.
      {1, 5, 3, 3, 4, 3, 1.5f, {}, {}},
      // A single token.
      {1, 1, 2, 1, 2, 0, 0.f, {}, {}},
  };
  double worst_q = 0, worst_k = 0, worst_v = 0, worst_fwd = 0;
  uint32_t seed = 50;
  for (const Case& c : cases) {
    AttentionShape s{c.B, c.T, 0, c.T, c.N, c.K, c.H, c.W, c.cap};
    const size_t q_size = size_t(c.B * c.T * c.N * c.H), kv_size = size_t(c.B * c.T * c.K * c.H);
    auto q = random_vector(q_size, seed++), k = random_vector(kv_size, seed++), v = random_vector(kv_size, seed++);
    auto dout = random_vector(q_size, seed++);
    std::vector<uint8_t> valid(size_t(c.B * c.T), 1);
    for (int64_t p : c.padding) valid[size_t(p)] = 0;

    // The fp64 reference agrees with the kernel's forward, so it differentiates the same function.
    std::vector<float> out(q_size);
    attention(q.data(), k.data(), v.data(), valid.data(), s, out.data());
    std::vector<double> qd = to_double(q), kd = to_double(k), vd = to_double(v);
    const auto ref = attention_fp64(qd, kd, vd, valid, s);
    for (size_t i = 0; i < q_size; ++i) {
      worst_fwd = std::max(worst_fwd, std::abs(out[i] - ref[i]));
      ASSERT_NEAR(out[i], ref[i], 1e-5) << i;
    }

    // Start the outputs dirty: the backward must overwrite, not accumulate.
    std::vector<float> dq(q_size, 7.f), dk(kv_size, 7.f), dv(kv_size, 7.f);
    attention_backward(q.data(), k.data(), v.data(), valid.data(), s, dout.data(), dq.data(), dk.data(), dv.data());

    auto loss = [&] {
      const auto y = attention_fp64(qd, kd, vd, valid, s);
      double L = 0;
      for (size_t i = 0; i < y.size(); ++i) L += double(dout[i]) * y[i];
      return L;
    };
    worst_q = std::max(worst_q, check_fp64_gradient(qd, dq, loss, 1e-4, "attention dq"));
    worst_k = std::max(worst_k, check_fp64_gradient(kd, dk, loss, 1e-4, "attention dk"));
    worst_v = std::max(worst_v, check_fp64_gradient(vd, dv, loss, 1e-4, "attention dv"));

    // Exact zeros where nothing flows: query rows with no allowed key, and padding keys.
    for (int64_t r : c.empty_rows)
      for (int64_t i = 0; i < c.N * c.H; ++i) {
        EXPECT_EQ(out[size_t(r * c.N * c.H + i)], 0.f);
        EXPECT_EQ(dq[size_t(r * c.N * c.H + i)], 0.f);
      }
    for (int64_t p : c.padding)
      for (int64_t i = 0; i < c.K * c.H; ++i) {
        EXPECT_EQ(dk[size_t(p * c.K * c.H + i)], 0.f);
        EXPECT_EQ(dv[size_t(p * c.K * c.H + i)], 0.f);
      }
  }
  std::printf("attention: forward vs fp64 max abs %.2e; max rel err dq %.2e, dk %.2e, dv %.2e\n", worst_fwd,
              worst_q, worst_k, worst_v);
}

}  // namespace

namespace {

// A low-rank term over freshly drawn A, B in one of the layouts LoRA uses: Keras per-head
// (groups > 1, A [g][in][r], B [r][og]), Keras dense (A [in][r], B [r][out]), PEFT (A [r][in],
// B [out][r]); `in_offset`/`out_offset` view only a part of a larger adapter, as a tensor-parallel
// rank does.
struct LowRankCase {
  const char* name;
  int64_t rank, groups, in, out_per_group;
  bool peft;
  int64_t in_full, out_full, in_offset, out_offset;  // the adapter's whole size and the part used
};

struct LowRankData {
  std::vector<float> a, b, grad_a, grad_b;
  LowRankTerm term;
};

LowRankData make_low_rank(const LowRankCase& c, uint32_t seed) {
  LowRankData d;
  const int64_t r = c.rank;
  LowRankTerm& t = d.term;
  t.rank = r, t.groups = c.groups, t.in = c.in, t.out_per_group = c.out_per_group, t.scale = 1.75f;
  if (c.groups > 1) {  // the whole adapter has c.out_full / og groups; use groups from out_offset / og
    const int64_t all_groups = c.out_full / c.out_per_group;
    d.a = random_vector(size_t(all_groups * c.in_full * r), seed);
    d.b = random_vector(size_t(r * c.out_per_group), seed + 1);
    t.a_group = c.in_full * r, t.a_row = r, t.a_col = 1, t.b_row = c.out_per_group, t.b_col = 1;
  } else if (!c.peft) {
    d.a = random_vector(size_t(c.in_full * r), seed);
    d.b = random_vector(size_t(r * c.out_full), seed + 1);
    t.a_row = r, t.a_col = 1, t.b_row = c.out_full, t.b_col = 1;
  } else {
    d.a = random_vector(size_t(r * c.in_full), seed);
    d.b = random_vector(size_t(c.out_full * r), seed + 1);
    t.a_row = 1, t.a_col = c.in_full, t.b_row = 1, t.b_col = r;
  }
  d.grad_a.assign(d.a.size(), 0.f);
  d.grad_b.assign(d.b.size(), 0.f);
  const int64_t a_offset = c.in_offset * t.a_row + (c.groups > 1 ? c.out_offset / c.out_per_group * t.a_group : 0);
  const int64_t b_offset = c.groups > 1 ? 0 : c.out_offset * t.b_col;
  t.a = d.a.data() + a_offset, t.grad_a = d.grad_a.data() + a_offset;
  t.b = d.b.data() + b_offset, t.grad_b = d.grad_b.data() + b_offset;
  return d;
}

const LowRankCase kLowRankCases[] = {
    {"keras per-head", 3, 4, 24, 8, false, 24, 32, 0, 0},
    {"keras per-head, heads 2..3 of 4", 3, 2, 24, 8, false, 24, 32, 0, 16},
    {"keras dense", 4, 1, 40, 24, false, 40, 24, 0, 0},
    {"keras dense, columns 8..19 of 24 (rows 10..29 of 40)", 4, 1, 20, 12, false, 40, 24, 10, 8},
    {"peft", 2, 1, 33, 17, true, 33, 17, 0, 0},
    {"peft, part", 2, 1, 16, 9, true, 33, 17, 11, 5},
    {"rank 1 peft", 1, 1, 9, 7, true, 9, 7, 0, 0},
    {"rank 1 keras", 1, 1, 9, 7, false, 9, 7, 0, 0},
};

}  // namespace

// The BLAS path against the plain loops, forward and backward, for every layout and for parts
// of an adapter; backward accumulates (a second call doubles the gradients).
TEST(KernelsBackward, LowRankMatchesReference) {
  for (const LowRankCase& c : kLowRankCases) {
    for (int64_t M : {1, 5, 64}) {
      const std::string name = std::string(c.name) + " M=" + std::to_string(M);
      LowRankData fast = make_low_rank(c, 3), ref = make_low_rank(c, 3);
      const int64_t out = fast.term.out();
      const std::vector<float> x = random_vector(size_t(M * c.in), 11), dy = random_vector(size_t(M * out), 12);
      std::vector<float> y = random_vector(size_t(M * out), 13), y_ref = y;  // += onto existing values
      low_rank_forward(x.data(), M, fast.term, y.data());
      low_rank_forward_reference(x.data(), M, ref.term, y_ref.data());
      for (size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], y_ref[i], 1e-4 * (1 + std::fabs(y_ref[i]))) << name;
      std::vector<float> dx = random_vector(size_t(M * c.in), 14), dx_ref = dx;
      low_rank_backward(x.data(), dy.data(), M, fast.term, dx.data());
      low_rank_backward_reference(x.data(), dy.data(), M, ref.term, dx_ref.data());
      for (size_t i = 0; i < dx.size(); ++i) ASSERT_NEAR(dx[i], dx_ref[i], 1e-4 * (1 + std::fabs(dx_ref[i]))) << name;
      for (size_t i = 0; i < fast.grad_a.size(); ++i)
        ASSERT_NEAR(fast.grad_a[i], ref.grad_a[i], 1e-4 * (1 + std::fabs(ref.grad_a[i]))) << name << " grad_a " << i;
      for (size_t i = 0; i < fast.grad_b.size(); ++i)
        ASSERT_NEAR(fast.grad_b[i], ref.grad_b[i], 1e-4 * (1 + std::fabs(ref.grad_b[i]))) << name << " grad_b " << i;
      const std::vector<float> once_a = fast.grad_a;
      low_rank_backward(x.data(), dy.data(), M, fast.term, nullptr);
      for (size_t i = 0; i < once_a.size(); ++i) ASSERT_NEAR(fast.grad_a[i], 2 * once_a[i], 1e-4 * (1 + std::fabs(once_a[i])));
    }
  }
}

// The reference backward against central differences of the reference forward (fp64 sums), so
// the reference itself is right: L = Σ c·y over x, A and B.
TEST(KernelsBackward, LowRankReferenceMatchesFiniteDifferences) {
  for (const LowRankCase& c : kLowRankCases) {
    const int64_t M = 3;
    LowRankData d = make_low_rank(c, 5);
    const int64_t out = d.term.out();
    std::vector<float> x = random_vector(size_t(M * c.in), 21);
    const std::vector<float> cw = random_vector(size_t(M * out), 22);
    auto loss = [&] {
      std::vector<float> y(size_t(M * out), 0.f);
      low_rank_forward_reference(x.data(), M, d.term, y.data());
      return weighted_sum(cw, y);
    };
    std::vector<float> dx(size_t(M * c.in), 0.f);
    low_rank_backward_reference(x.data(), cw.data(), M, d.term, dx.data());
    check_fp32_gradient(x, dx, loss, 1e-2f, 2e-3, c.name);
    const std::vector<float> ga = d.grad_a, gb = d.grad_b;
    check_fp32_gradient(d.a, ga, loss, 1e-2f, 2e-3, c.name);  // entries outside the part: zero both ways
    check_fp32_gradient(d.b, gb, loss, 1e-2f, 2e-3, c.name);
  }
}

namespace {

// Σ w·CE over the rows by the kernel's steps, with the vocabulary split into `parts` column blocks
// combined as the vocabulary-parallel path combines them (all-gather of the maxima, sums added).
std::array<double, 3> loss_by_parts(const std::vector<float>& z, int64_t n, int64_t V, int parts,
                                    const std::vector<int32_t>& targets, const std::vector<float>& weights,
                                    const std::vector<int64_t>& rows) {
  const int64_t part = V / parts;
  std::vector<std::vector<float>> blocks(static_cast<size_t>(parts));
  std::vector<SoftmaxRows> stats(static_cast<size_t>(parts));
  std::vector<float> gathered;
  for (int p = 0; p < parts; ++p) {
    for (int64_t i = 0; i < n; ++i)
      blocks[size_t(p)].insert(blocks[size_t(p)].end(), z.begin() + i * V + p * part, z.begin() + i * V + (p + 1) * part);
    softmax_row_max(blocks[size_t(p)].data(), n, part, p * part, stats[size_t(p)]);
    gathered.insert(gathered.end(), stats[size_t(p)].max.begin(), stats[size_t(p)].max.end());
    gathered.insert(gathered.end(), stats[size_t(p)].argmax.begin(), stats[size_t(p)].argmax.end());
  }
  std::vector<double> total(size_t(2 * n), 0.0);
  for (int p = 0; p < parts; ++p) {
    softmax_combine_max(gathered.data(), parts, n, stats[size_t(p)]);
    softmax_row_sums(blocks[size_t(p)].data(), n, part, p * part, targets.data(), rows.data(), stats[size_t(p)]);
    for (size_t i = 0; i < total.size(); ++i) total[i] += stats[size_t(p)].sum_exp_and_target[i];
  }
  stats[0].sum_exp_and_target = total;
  double sums[3] = {0, 0, 0};
  softmax_cross_entropy_sums(stats[0], targets.data(), weights.data(), rows.data(), n, sums);
  return {sums[0], sums[1], sums[2]};
}

}  // namespace

// The chunked cross-entropy against log-softmax in fp64, split over 1, 2 and 4 vocabulary parts
// (the vocabulary-parallel hooks), and its backward (through a soft cap) against finite differences.
TEST(KernelsBackward, CrossEntropyMatchesFp64AndSplitsOverTheVocabulary) {
  const int64_t n = 5, V = 48, M = 9;
  std::vector<float> z = random_vector(size_t(n * V), 31, 3.f);
  const std::vector<int64_t> rows = {0, 2, 3, 7, 8};  // chunk row i is batch row rows[i]
  std::vector<int32_t> targets(M);
  std::vector<float> weights(M);
  for (int64_t m = 0; m < M; ++m) targets[size_t(m)] = int32_t((m * 13 + 5) % V), weights[size_t(m)] = 0.5f + 0.25f * float(m % 3);
  z[size_t(2 * V + 7)] = z[size_t(2 * V + 40)] = 50.f;  // a tie: the first index wins
  double want = 0, want_correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    double max = -1e30, sum = 0;
    int64_t best = 0;
    for (int64_t v = 0; v < V; ++v)
      if (z[size_t(i * V + v)] > max) max = z[size_t(i * V + v)], best = v;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(z[size_t(i * V + v)]) - max);
    const double w = weights[size_t(rows[size_t(i)])];
    want += w * (std::log(sum) + max - z[size_t(i * V + targets[size_t(rows[size_t(i)])])]);
    want_correct += w * (best == targets[size_t(rows[size_t(i)])] ? 1 : 0);
  }
  for (int parts : {1, 2, 4}) {
    const auto got = loss_by_parts(z, n, V, parts, targets, weights, rows);
    EXPECT_NEAR(got[0], want, 1e-5 * std::fabs(want)) << parts << " parts";
    EXPECT_EQ(got[1], want_correct) << parts << " parts";
  }
  // Backward through a soft cap of 30: ∂(scale·Σ w·CE(cap·tanh(z/cap)))/∂(capped z) as the kernel
  // forms it, chained to the raw z by (1 − (z_c/cap)²).
  const float cap = 30.f;
  const double scale = 0.7;
  auto capped = [&](const std::vector<float>& raw) {
    std::vector<float> c(raw);
    for (float& v : c) v = std::tanh(v / cap) * cap;
    return c;
  };
  auto loss = [&] { return scale * loss_by_parts(capped(z), n, V, 1, targets, weights, rows)[0]; };
  std::vector<float> dz = capped(z);
  SoftmaxRows stats;
  softmax_row_max(dz.data(), n, V, 0, stats);
  softmax_row_sums(dz.data(), n, V, 0, targets.data(), rows.data(), stats);
  softmax_cross_entropy_backward(dz.data(), n, V, 0, targets.data(), weights.data(), rows.data(), scale, stats, cap);
  z[size_t(2 * V + 7)] = z[size_t(2 * V + 40)] = 2.f;  // away from the flat top of tanh for differencing
  dz = capped(z);
  softmax_row_max(dz.data(), n, V, 0, stats);
  softmax_row_sums(dz.data(), n, V, 0, targets.data(), rows.data(), stats);
  softmax_cross_entropy_backward(dz.data(), n, V, 0, targets.data(), weights.data(), rows.data(), scale, stats, cap);
  check_fp32_gradient(z, dz, loss, 1e-2f, 2e-3, "cross-entropy");
}
