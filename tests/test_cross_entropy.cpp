// The vocabulary-parallel composition of the chunked cross-entropy's steps (the steps themselves are
// op cases in test_backend_ops.cpp): split over 1, 2 and 4 vocabulary parts and combined as the
// model combines them over processes, against log-softmax in fp64, with its backward through a
// soft cap against finite differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "test_util.h"

using namespace meshtune;
using meshtune::testing::cpu_backend;
using meshtune::testing::random_vector;

namespace {

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

// Σ w·CE over the rows by the CPU backend's steps, with the vocabulary split into `parts` column
// blocks combined as the vocabulary-parallel path combines them (all-gather of the maxima, sums added).
std::array<double, 3> loss_by_parts(const std::vector<float>& z, int64_t n, int64_t V, int parts,
                                    const std::vector<int32_t>& targets, const std::vector<float>& weights) {
  Backend& b = cpu_backend();
  const int64_t part = V / parts;
  std::vector<std::vector<float>> blocks(static_cast<size_t>(parts));
  std::vector<SoftmaxRows> stats(static_cast<size_t>(parts));
  std::vector<float> gathered;
  for (int p = 0; p < parts; ++p) {
    for (int64_t i = 0; i < n; ++i)
      blocks[size_t(p)].insert(blocks[size_t(p)].end(), z.begin() + i * V + p * part, z.begin() + i * V + (p + 1) * part);
    b.softmax_row_max(blocks[size_t(p)], n, part, p * part, stats[size_t(p)]);
    const float* mine = stats[size_t(p)].max_and_argmax.data();
    gathered.insert(gathered.end(), mine, mine + 2 * n);
  }
  std::vector<double> total(size_t(2 * n), 0.0);
  for (int p = 0; p < parts; ++p) {
    b.softmax_combine_max(gathered, parts, n, stats[size_t(p)]);
    b.softmax_row_sums(blocks[size_t(p)], n, part, p * part, targets, stats[size_t(p)]);
    for (size_t i = 0; i < total.size(); ++i) total[i] += stats[size_t(p)].sum_exp_and_target.data()[i];
  }
  std::copy(total.begin(), total.end(), stats[0].sum_exp_and_target.data());
  std::vector<double> sums(3, 0.0);
  b.softmax_cross_entropy_sums(stats[0], targets, weights, n, sums);
  return {sums[0], sums[1], sums[2]};
}

}  // namespace

// The chunked cross-entropy against log-softmax in fp64, split over 1, 2 and 4 vocabulary parts
// (the vocabulary-parallel hooks), and its backward (through a soft cap) against finite differences.
TEST(CrossEntropy, MatchesFp64AndSplitsOverTheVocabulary) {
  const int64_t n = 5, V = 48;
  std::vector<float> z = random_vector(size_t(n * V), 31, 3.f);
  const std::vector<int64_t> rows = {0, 2, 3, 7, 8};  // chunk row i is batch row rows[i] of 9
  std::vector<int32_t> targets;  // of the chunk's rows
  std::vector<float> weights;
  for (int64_t m : rows) targets.push_back(int32_t((m * 13 + 5) % V)), weights.push_back(0.5f + 0.25f * float(m % 3));
  z[size_t(2 * V + 7)] = z[size_t(2 * V + 40)] = 50.f;  // a tie: the first index wins
  double want = 0, want_correct = 0;
  for (int64_t i = 0; i < n; ++i) {
    double max = -1e30, sum = 0;
    int64_t best = 0;
    for (int64_t v = 0; v < V; ++v)
      if (z[size_t(i * V + v)] > max) max = z[size_t(i * V + v)], best = v;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(z[size_t(i * V + v)]) - max);
    const double w = weights[size_t(i)];
    want += w * (std::log(sum) + max - z[size_t(i * V + targets[size_t(i)])]);
    want_correct += w * (best == targets[size_t(i)] ? 1 : 0);
  }
  for (int parts : {1, 2, 4}) {
    const auto got = loss_by_parts(z, n, V, parts, targets, weights);
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
  auto loss = [&] { return scale * loss_by_parts(capped(z), n, V, 1, targets, weights)[0]; };
  std::vector<float> dz = capped(z);
  Backend& b = cpu_backend();
  SoftmaxRows stats;
  b.softmax_row_max(dz, n, V, 0, stats);
  b.softmax_row_sums(dz, n, V, 0, targets, stats);
  b.softmax_cross_entropy_backward(dz, n, V, 0, targets, weights, scale, stats, cap);
  z[size_t(2 * V + 7)] = z[size_t(2 * V + 40)] = 2.f;  // away from the flat top of tanh for differencing
  dz = capped(z);
  b.softmax_row_max(dz, n, V, 0, stats);
  b.softmax_row_sums(dz, n, V, 0, targets, stats);
  b.softmax_cross_entropy_backward(dz, n, V, 0, targets, weights, scale, stats, cap);
  check_fp32_gradient(z, dz, loss, 1e-2f, 2e-3, "cross-entropy");
}
