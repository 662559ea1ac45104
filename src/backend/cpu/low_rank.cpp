#include "backend/cpu/low_rank.h"

#include <cblas.h>

#include <algorithm>
#include <vector>

namespace meshtune {

namespace {

// The rank-r factors gathered into contiguous matrices once per call (they are small: in·G·r and
// r·og floats), so that x·A of every group is one sgemm and the products with B are plain loops
// over the output (r ≤ a few dozen: a GEMM per group would be all call overhead).
struct Factors {
  int64_t R = 0;                   // groups · rank
  std::vector<float> a;            // [in, R]: a(i, g·r + j) = A_g(i, j)
  std::vector<float> b;            // [r, og]: b(j, o) = B(j, o)
};

Factors gather_factors(const LowRankTerm& t) {
  Factors f;
  const int64_t r = t.rank, og = t.out_per_group;
  f.R = t.groups * r;
  f.a.resize(size_t(t.in * f.R));
  for (int64_t g = 0; g < t.groups; ++g)
    for (int64_t i = 0; i < t.in; ++i)
      for (int64_t j = 0; j < r; ++j) f.a[size_t(i * f.R + g * r + j)] = t.a[g * t.a_group + i * t.a_row + j * t.a_col];
  f.b.resize(size_t(r * og));
  for (int64_t j = 0; j < r; ++j)
    for (int64_t o = 0; o < og; ++o) f.b[size_t(j * og + o)] = t.b[j * t.b_row + o * t.b_col];
  return f;
}

// u[M, R] = x[M, in] · A (all groups at once).
void project_down(const float* x, int64_t M, const LowRankTerm& t, const Factors& f, float* u) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(f.R), int(t.in), 1.f, x, int(t.in), f.a.data(),
              int(f.R), 0.f, u, int(f.R));
}

}  // namespace

void low_rank_forward(const float* x, int64_t M, const LowRankTerm& t, float* y) {
  if (!t.active() || M == 0) return;
  const Factors f = gather_factors(t);
  const int64_t r = t.rank, og = t.out_per_group, out = t.out(), R = f.R;
  std::vector<float> u(static_cast<size_t>(M * R));
  project_down(x, M, t, f, u.data());
  // y[m, g·og + o] += scale · Σ_j u[m, g·r + j] · B(j, o)
#pragma omp parallel for schedule(static) if (M * out * r > 65536)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < t.groups; ++g) {
      float* yg = y + m * out + g * og;
      for (int64_t j = 0; j < r; ++j) {
        const float c = t.scale * u[size_t(m * R + g * r + j)];
        const float* bj = f.b.data() + j * og;
        for (int64_t o = 0; o < og; ++o) yg[o] += c * bj[o];
      }
    }
}

void low_rank_backward(const float* x, const float* dy, int64_t M, const LowRankTerm& t, float* dx) {
  if (!t.active() || M == 0) return;
  const Factors f = gather_factors(t);
  const int64_t r = t.rank, og = t.out_per_group, out = t.out(), R = f.R;
  // v[m, g·r + j] = Σ_o dy[m, g·og + o] · B(j, o)
  std::vector<float> v(static_cast<size_t>(M * R));
#pragma omp parallel for schedule(static) if (M * out * r > 65536)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < t.groups; ++g) {
      const float* dyg = dy + m * out + g * og;
      for (int64_t j = 0; j < r; ++j) {
        const float* bj = f.b.data() + j * og;
        float acc = 0;
        for (int64_t o = 0; o < og; ++o) acc += dyg[o] * bj[o];
        v[size_t(m * R + g * r + j)] = acc;
      }
    }
  // dx[M, in] += scale · v · Aᵀ
  if (dx)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(t.in), int(R), t.scale, v.data(), int(R),
                f.a.data(), int(R), 1.f, dx, int(t.in));
  // ∂A [in, R] = scale · xᵀ · v, added into each group's strided A
  if (t.grad_a) {
    std::vector<float> grad(static_cast<size_t>(t.in * R));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(t.in), int(R), int(M), t.scale, x, int(t.in), v.data(),
                int(R), 0.f, grad.data(), int(R));
    for (int64_t g = 0; g < t.groups; ++g)
      for (int64_t i = 0; i < t.in; ++i)
        for (int64_t j = 0; j < r; ++j) t.grad_a[g * t.a_group + i * t.a_row + j * t.a_col] += grad[size_t(i * R + g * r + j)];
  }
  // ∂B(j, o) += scale · Σ_m Σ_g u[m, g·r + j] · dy[m, g·og + o] with u = x · A
  if (t.grad_b) {
    std::vector<float> u(static_cast<size_t>(M * R)), grad(static_cast<size_t>(r * og), 0.f);
    project_down(x, M, t, f, u.data());
#pragma omp parallel for schedule(static) if (M * out * r > 65536)
    for (int64_t o0 = 0; o0 < og; o0 += 64) {  // each thread owns a band of B's columns
      const int64_t o1 = std::min(og, o0 + 64);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < t.groups; ++g) {
          const float* dyg = dy + m * out + g * og;
          for (int64_t j = 0; j < r; ++j) {
            const float c = u[size_t(m * R + g * r + j)];
            float* gj = grad.data() + j * og;
            for (int64_t o = o0; o < o1; ++o) gj[o] += c * dyg[o];
          }
        }
    }
    for (int64_t j = 0; j < r; ++j)
      for (int64_t o = 0; o < og; ++o) t.grad_b[j * t.b_row + o * t.b_col] += t.scale * grad[size_t(j * og + o)];
  }
}

}  // namespace meshtune
