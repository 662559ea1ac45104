#include "kernels/low_rank.h"

#include <cblas.h>

#include <algorithm>
#include <vector>

namespace meshtune {

namespace {

// A strided [rows, cols] matrix (element (i, j) at p[i·row + j·col], one stride 1) as BLAS sees
// it: row-major, or the transpose of a row-major matrix. (With one row or one column both strides
// may be 1; BLAS then still wants a leading dimension of at least the row length.)
struct Operand {
  const float* p;
  CBLAS_TRANSPOSE trans;
  int ld;
};
bool row_major(int64_t rows, int64_t cols, int64_t row, int64_t col) { return col == 1 && (rows == 1 || row >= cols); }
Operand operand(const float* p, int64_t rows, int64_t cols, int64_t row, int64_t col) {
  if (row_major(rows, cols, row, col)) return {p, CblasNoTrans, int(std::max(row, cols))};
  return {p, CblasTrans, int(std::max(col, rows))};
}

// C[m, n] (row-major, ld c_ld) = alpha·P[m, k]·Q[k, n] + beta·C.
void gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* p, int64_t p_row, int64_t p_col, const float* q,
          int64_t q_row, int64_t q_col, float beta, float* c, int64_t c_ld) {
  const Operand P = operand(p, m, k, p_row, p_col), Q = operand(q, k, n, q_row, q_col);
  cblas_sgemm(CblasRowMajor, P.trans, Q.trans, int(m), int(n), int(k), alpha, P.p, P.ld, Q.p, Q.ld, beta, c,
              int(std::max(c_ld, n)));
}

// Adds alpha·P[m, k]·Q[k, n] into the strided matrix G(i, j) = g[i·row + j·col]: computed as
// C += P·Q when G is row-major, else as Gᵀ += Qᵀ·Pᵀ.
void gemm_into(int64_t m, int64_t n, int64_t k, float alpha, const float* p, int64_t p_row, int64_t p_col,
               const float* q, int64_t q_row, int64_t q_col, float* g, int64_t row, int64_t col) {
  if (row_major(m, n, row, col)) return gemm(m, n, k, alpha, p, p_row, p_col, q, q_row, q_col, 1.f, g, row);
  gemm(n, m, k, alpha, q, q_col, q_row, p, p_col, p_row, 1.f, g, col);
}

}  // namespace

void low_rank_forward(const float* x, int64_t M, const LowRankTerm& t, float* y) {
  if (!t.active() || M == 0) return;
  const int64_t r = t.rank, out = t.out();
  std::vector<float> u(static_cast<size_t>(M * r));
  for (int64_t g = 0; g < t.groups; ++g) {
    // u[M, r] = x · A_g, then y_g += scale · u · B
    gemm(M, r, t.in, 1.f, x, t.in, 1, t.a + g * t.a_group, t.a_row, t.a_col, 0.f, u.data(), r);
    gemm(M, t.out_per_group, r, t.scale, u.data(), r, 1, t.b, t.b_row, t.b_col, 1.f, y + g * t.out_per_group, out);
  }
}

void low_rank_backward(const float* x, const float* dy, int64_t M, const LowRankTerm& t, float* dx) {
  if (!t.active() || M == 0) return;
  const int64_t r = t.rank, out = t.out(), og = t.out_per_group;
  std::vector<float> u(static_cast<size_t>(M * r)), v(static_cast<size_t>(M * r));
  for (int64_t g = 0; g < t.groups; ++g) {
    const float* a = t.a + g * t.a_group;
    const float* dy_g = dy + g * og;
    // v[M, r] = dy_g · Bᵀ (Bᵀ(o, j) = b[o·b_col + j·b_row])
    gemm(M, r, og, 1.f, dy_g, out, 1, t.b, t.b_col, t.b_row, 0.f, v.data(), r);
    // dx += scale · v · A_gᵀ
    if (dx) gemm(M, t.in, r, t.scale, v.data(), r, 1, a, t.a_col, t.a_row, 1.f, dx, t.in);
    // ∂A_g [in, r] += scale · xᵀ · v
    if (t.grad_a)
      gemm_into(t.in, r, M, t.scale, x, 1, t.in, v.data(), r, 1, t.grad_a + g * t.a_group, t.a_row, t.a_col);
    if (t.grad_b) {
      // ∂B [r, og] += scale · uᵀ · dy_g with u = x · A_g
      gemm(M, r, t.in, 1.f, x, t.in, 1, a, t.a_row, t.a_col, 0.f, u.data(), r);
      gemm_into(r, og, M, t.scale, u.data(), 1, r, dy_g, out, 1, t.grad_b, t.b_row, t.b_col);
    }
  }
}

void low_rank_forward_reference(const float* x, int64_t M, const LowRankTerm& t, float* y) {
  const int64_t r = t.rank, out = t.out();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < t.groups; ++g)
      for (int64_t o = 0; o < t.out_per_group; ++o) {
        double acc = 0;
        for (int64_t j = 0; j < r; ++j) {
          double u = 0;
          for (int64_t i = 0; i < t.in; ++i) u += double(x[m * t.in + i]) * t.a[g * t.a_group + i * t.a_row + j * t.a_col];
          acc += u * t.b[j * t.b_row + o * t.b_col];
        }
        y[m * out + g * t.out_per_group + o] += float(t.scale * acc);
      }
}

void low_rank_backward_reference(const float* x, const float* dy, int64_t M, const LowRankTerm& t, float* dx) {
  const int64_t r = t.rank, out = t.out(), og = t.out_per_group;
  for (int64_t g = 0; g < t.groups; ++g) {
    auto A = [&](int64_t i, int64_t j) { return double(t.a[g * t.a_group + i * t.a_row + j * t.a_col]); };
    auto B = [&](int64_t j, int64_t o) { return double(t.b[j * t.b_row + o * t.b_col]); };
    for (int64_t m = 0; m < M; ++m) {
      std::vector<double> u(static_cast<size_t>(r), 0.0), v(static_cast<size_t>(r), 0.0);
      for (int64_t j = 0; j < r; ++j) {
        for (int64_t i = 0; i < t.in; ++i) u[size_t(j)] += double(x[m * t.in + i]) * A(i, j);
        for (int64_t o = 0; o < og; ++o) v[size_t(j)] += double(dy[m * out + g * og + o]) * B(j, o);
      }
      for (int64_t j = 0; j < r; ++j) {
        for (int64_t i = 0; i < t.in; ++i) {
          if (dx) dx[m * t.in + i] += float(t.scale * v[size_t(j)] * A(i, j));
          if (t.grad_a) t.grad_a[g * t.a_group + i * t.a_row + j * t.a_col] += float(t.scale * double(x[m * t.in + i]) * v[size_t(j)]);
        }
        if (t.grad_b)
          for (int64_t o = 0; o < og; ++o)
            t.grad_b[j * t.b_row + o * t.b_col] += float(t.scale * u[size_t(j)] * double(dy[m * out + g * og + o]));
      }
    }
  }
}

}  // namespace meshtune
