// The vector loops of the elementwise kernels (backend/cpu/isa/vector_ops.h), on every CPU path this
// machine has, against plain loops in double (AdamW: in fp32, bit for bit).

// The AdamW reference rounds every operation separately, as the kernel must.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/tensor.h"
#include "cpu_path_test.h"
#include "backend/cpu/isa/vector_ops.h"
#include "test_util.h"

namespace meshtune {
namespace {

using testing::CpuPathTest;
using testing::random_vector;

// Lengths around the 32-lane blocks and the vector widths (4, 8, 16), and a long one.
const int64_t kLengths[] = {1, 3, 8, 15, 16, 31, 32, 33, 64, 100, 257, 2048 + 7};

class VectorOps : public CpuPathTest {
 protected:
  const cpu::VectorOps& ops() const { return path().ops(); }
};

// |a − b| ≤ tol·scale, where scale is the size of the terms that made b.
void expect_close(double got, double want, double scale, double tol, const char* what, int64_t n, int64_t i = -1) {
  EXPECT_LE(std::abs(got - want), tol * scale) << what << " n=" << n << " i=" << i << " got " << got << " want " << want;
}

TEST_P(VectorOps, PathPicksItsOwnSet) {
  const cpu::VectorOps* want = &cpu::vector_ops_generic();
  if (GetParam() == CpuPath::Avx2) want = &cpu::vector_ops_avx2();
  if (GetParam() == CpuPath::Avx512 || GetParam() == CpuPath::Avx512Bf16) want = &cpu::vector_ops_avx512();
  EXPECT_EQ(&ops(), want);
}

TEST_P(VectorOps, DotAndAxpy) {
  for (int64_t n : kLengths) {
    const auto a = random_vector(size_t(n), 1), b = random_vector(size_t(n), 2);
    double want = 0, scale = 0;
    for (int64_t i = 0; i < n; ++i) want += double(a[i]) * b[i], scale += std::abs(double(a[i]) * b[i]);
    expect_close(ops().dot(a.data(), b.data(), n), want, scale, 1e-6, "dot", n);

    std::vector<float> y = b;
    ops().axpy(0.37f, a.data(), y.data(), n);
    for (int64_t i = 0; i < n; ++i) expect_close(y[i], b[i] + 0.37 * a[i], std::abs(b[i]) + 0.37 * std::abs(a[i]), 1.5e-7, "axpy", n, i);
  }
}

TEST_P(VectorOps, RmsNormRowAndBackward) {
  const float eps = 1e-6f;
  for (int64_t n : kLengths) {
    const auto x = random_vector(size_t(n), 3, 2.f), scale = random_vector(size_t(n), 4, 0.5f);
    const auto dy = random_vector(size_t(n), 5);
    double mean_sq = 0;
    for (int64_t i = 0; i < n; ++i) mean_sq += double(x[i]) * x[i] / double(n);
    const double r = 1 / std::sqrt(mean_sq + eps);

    std::vector<float> y(static_cast<size_t>(n));
    ops().rmsnorm_row(x.data(), scale.data(), n, eps, y.data());
    for (int64_t i = 0; i < n; ++i) {
      const double w = 1.0 + scale[i];
      expect_close(y[i], x[i] * r * w, std::abs(x[i] * r * w) + 1e-3, 1e-6, "rmsnorm", n, i);
    }

    double sum = 0;  // Σ dy·w·x
    for (int64_t i = 0; i < n; ++i) sum += double(dy[i]) * (1.0 + scale[i]) * x[i];
    std::vector<float> dx = dy, dscale(static_cast<size_t>(n), 0.25f);  // dx aliases dy; dscale accumulates
    ops().rmsnorm_backward_row(x.data(), scale.data(), n, eps, dx.data(), dx.data(), dscale.data());
    for (int64_t i = 0; i < n; ++i) {
      const double w = 1.0 + scale[i];
      const double want_dx = r * w * dy[i] - r * r * r / double(n) * x[i] * sum;
      const double size = std::abs(r * w * dy[i]) + std::abs(r * r * r / double(n) * x[i]) * std::abs(sum) + 1e-3;
      expect_close(dx[i], want_dx, size, 1e-5, "rmsnorm dx", n, i);
      expect_close(dscale[i], 0.25 + double(dy[i]) * x[i] * r, std::abs(dy[i] * x[i] * r) + 0.25, 1e-6, "dscale", n, i);
    }
    std::vector<float> dx_only(static_cast<size_t>(n));
    ops().rmsnorm_backward_row(x.data(), scale.data(), n, eps, dy.data(), dx_only.data(), nullptr);
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(dx_only[i], dx[i]) << "a null dscale changes dx, n=" << n;
  }
}

double gelu_tanh(double u) { return 0.5 * u * (1 + std::tanh(std::sqrt(2 / M_PI) * (u + 0.044715 * u * u * u))); }

TEST_P(VectorOps, GegluAndBackward) {
  for (int64_t n : kLengths) {
    auto gate = random_vector(size_t(n), 6, 4.f);
    if (n > 4) gate[0] = 30.f, gate[1] = -30.f, gate[2] = 1e4f, gate[3] = -1e4f;  // the tails of the GELU
    const auto up = random_vector(size_t(n), 7), dout = random_vector(size_t(n), 8);
    std::vector<float> out = gate;
    ops().geglu(out.data(), up.data(), n, out.data());  // in place, as inference runs it
    std::vector<float> dgate(static_cast<size_t>(n)), dup(static_cast<size_t>(n));
    ops().geglu_backward(gate.data(), up.data(), dout.data(), n, dgate.data(), dup.data());
    for (int64_t i = 0; i < n; ++i) {
      const double u = gate[i], g = gelu_tanh(u);
      expect_close(out[i], g * up[i], std::abs(u * up[i]) + 1e-6, 2e-6, "geglu", n, i);
      expect_close(dup[i], dout[i] * g, std::abs(dout[i] * u) + 1e-6, 2e-6, "geglu dup", n, i);
      const double h = 1e-4 * std::max(1.0, std::abs(u));  // d gelu/du by central difference in double
      const double slope = (gelu_tanh(u + h) - gelu_tanh(u - h)) / (2 * h);
      expect_close(dgate[i], double(dout[i]) * up[i] * slope, std::abs(dout[i] * up[i]) + 1e-6, 1e-5, "geglu dgate", n,
                   i);
    }
  }
}

TEST_P(VectorOps, RotateHalves) {
  for (int64_t half : kLengths) {
    const auto v0 = random_vector(size_t(2 * half), 9), angle = random_vector(size_t(half), 10, 3.f);
    std::vector<float> cos(static_cast<size_t>(half)), sin(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) cos[i] = std::cos(angle[i]), sin[i] = std::sin(angle[i]);
    std::vector<float> v = v0;
    ops().rotate_halves(v.data(), cos.data(), sin.data(), half);
    for (int64_t i = 0; i < half; ++i) {
      // Each output is one product minus (plus) another, rounded separately, on every path.
      EXPECT_EQ(v[i], v0[i] * cos[i] - v0[i + half] * sin[i]) << "half=" << half << " i=" << i;
      EXPECT_EQ(v[i + half], v0[i + half] * cos[i] + v0[i] * sin[i]) << "half=" << half << " i=" << i;
    }
  }
}

TEST_P(VectorOps, ExpIsWithinFourUlpAndZeroBelowItsRange) {
  for (float x = -87.f; x <= 88.f; x += 0.0371f) {
    const double want = std::exp(double(x));
    EXPECT_LE(std::abs(ops().exp(x) - want), 4 * 6e-8 * want) << "x=" << x;
  }
  EXPECT_EQ(ops().exp(-INFINITY), 0.f);
  EXPECT_EQ(ops().exp(-100.f), 0.f);
  EXPECT_EQ(ops().exp(0.f), 1.f);
  EXPECT_TRUE(std::isnan(ops().exp(NAN)));
}

TEST_P(VectorOps, ExpShiftedAndSums) {
  for (int64_t n : kLengths) {
    auto x = random_vector(size_t(n), 11, 8.f);
    if (n > 2) x[1] = -INFINITY;  // a masked score
    const float shift = 3.5f;
    double want_sum = 0;
    std::vector<double> want(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) want_sum += want[i] = std::exp(double(x[i] - shift));  // x − shift in fp32, as the kernel

    expect_close(ops().sum_exp_shifted(x.data(), n, shift), want_sum, want_sum, 1e-6, "sum_exp_shifted", n);
    std::vector<float> e = x;
    expect_close(ops().exp_shifted(e.data(), n, shift), want_sum, want_sum, 2e-6, "exp_shifted sum", n);
    for (int64_t i = 0; i < n; ++i) expect_close(e[i], want[i], want[i], 5e-7, "exp_shifted", n, i);
    if (n > 2) {
      EXPECT_EQ(e[1], 0.f);
    }
  }
}

TEST_P(VectorOps, SoftmaxGradient) {
  for (float cap : {0.f, 30.f}) {
    for (int64_t n : kLengths) {
      auto z = random_vector(size_t(n), 12, 8.f);
      if (cap > 0)
        for (float& v : z) v = std::max(-0.95f * cap, std::min(0.95f * cap, v));  // capped logits lie within ±cap
      const float shift = 10.f, scale = 0.125f;
      std::vector<float> g = z;
      ops().softmax_gradient(g.data(), n, shift, scale, cap);
      for (int64_t i = 0; i < n; ++i) {
        const double t = cap > 0 ? double(z[i]) / cap : 0, e = std::exp(double(z[i] - shift)) * scale;
        expect_close(g[i], e * (1 - t * t), e * (1 + t * t), 1e-6, "softmax_gradient", n, i);
      }
    }
  }
}

TEST_P(VectorOps, NarrowToBf16EqualsTheScalarRoundingBitForBit) {
  std::vector<float> x = random_vector(2048 + 7, 17, 100.f);
  for (uint32_t bits : {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffffffffu,
                        0x00000001u, 0x007fffffu, 0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x7f7fffffu})
    x.push_back(std::bit_cast<float>(bits));  // zeros, infinities, NaNs, denormals, ties, the largest finite
  std::vector<uint16_t> got(x.size());
  ops().narrow_bf16(x.data(), int64_t(x.size()), got.data());
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(got[i], f32_to_bf16(x[i])) << i << " " << x[i];
}

TEST_P(VectorOps, AdamWMatchesThePlainLoopBitForBit) {
  for (bool decay : {false, true}) {
    for (int64_t n : kLengths) {
      const auto theta0 = random_vector(size_t(n), 13), g = random_vector(size_t(n), 14, 0.1f);
      auto m0 = random_vector(size_t(n), 15, 0.01f), v0 = random_vector(size_t(n), 16, 0.001f);
      for (float& v : v0) v = std::abs(v);
      const AdamWStep s{.decay = decay,
                        .weight_decay = 0.01f,
                        .learning_rate = 5e-5f,
                        .one_minus_beta_1 = 0.1f,
                        .one_minus_beta_2 = 0.001f,
                        .alpha = 3.3e-5f,
                        .epsilon = 1e-7f};
      std::vector<float> theta = theta0, m = m0, v = v0;
      ops().adamw(theta.data(), g.data(), m.data(), v.data(), n, s);
      for (int64_t i = 0; i < n; ++i) {
        float t = theta0[i], mi = m0[i], vi = v0[i];
        if (decay) t = t - (t * s.weight_decay) * s.learning_rate;
        mi = mi + (g[i] - mi) * s.one_minus_beta_1;
        vi = vi + (g[i] * g[i] - vi) * s.one_minus_beta_2;
        t = t - (mi * s.alpha) / (std::sqrt(vi) + s.epsilon);
        EXPECT_EQ(m[i], mi) << "n=" << n << " i=" << i;
        EXPECT_EQ(v[i], vi) << "n=" << n << " i=" << i;
        EXPECT_EQ(theta[i], t) << "n=" << n << " i=" << i << " decay=" << decay;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(CpuPaths, VectorOps, testing::kEveryCpuPath, testing::cpu_path_test_name);

}  // namespace
}  // namespace meshtune
