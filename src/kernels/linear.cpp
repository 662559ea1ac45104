#include "kernels/linear.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
// GCC 12 warns falsely inside _mm512_reduce_add_ps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace meshtune {

void WeightMatrix::row_to_f32(int64_t r, float* out) const {
  if (dtype == DType::F32) {
    std::copy(f32() + r * cols, f32() + (r + 1) * cols, out);
  } else {
    const uint16_t* src = bf16() + r * cols;
    for (int64_t c = 0; c < cols; ++c) out[c] = bf16_to_f32(src[c]);
  }
}

std::vector<float> WeightMatrix::to_f32() const {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) row_to_f32(r, out.data() + r * cols);
  return out;
}

WeightMatrix WeightMatrix::from_f32(int64_t rows, int64_t cols, std::vector<float> values) {
  auto data = std::make_shared<std::vector<float>>(std::move(values));
  WeightMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.dtype = DType::F32;
  m.data = data->data();
  m.owner = data;
  return m;
}

void linear_reference(const float* x, int64_t M, const WeightMatrix& W, float* y) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < W.rows; ++r) {
      double acc = 0;
      for (int64_t c = 0; c < W.cols; ++c) acc += double(x[m * W.cols + c]) * W.at(r, c);
      y[m * W.rows + r] = float(acc);
    }
}

// ---- few-row path: each output row of W is read once and dotted with every x row -------------

#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline float load1(const float* p) { return *p; }
static inline float load1(const uint16_t* p) { return bf16_to_f32(*p); }

// Four weight rows at a time against one x row: four independent accumulators hide FMA latency.
template <typename T>
static void dot4(const float* x, const T* w0, const T* w1, const T* w2, const T* w3, int64_t n, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    __m512 xv = _mm512_loadu_ps(x + k);
    a0 = _mm512_fmadd_ps(xv, load16(w0 + k), a0);
    a1 = _mm512_fmadd_ps(xv, load16(w1 + k), a1);
    a2 = _mm512_fmadd_ps(xv, load16(w2 + k), a2);
    a3 = _mm512_fmadd_ps(xv, load16(w3 + k), a3);
  }
  float s0 = _mm512_reduce_add_ps(a0), s1 = _mm512_reduce_add_ps(a1);
  float s2 = _mm512_reduce_add_ps(a2), s3 = _mm512_reduce_add_ps(a3);
  for (; k < n; ++k) {
    s0 += x[k] * load1(w0 + k); s1 += x[k] * load1(w1 + k);
    s2 += x[k] * load1(w2 + k); s3 += x[k] * load1(w3 + k);
  }
  out[0] = s0; out[1] = s1; out[2] = s2; out[3] = s3;
}
template <typename T>
static float dot1(const float* x, const T* w, int64_t n) {
  __m512 a = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(w + k), a);
  float s = _mm512_reduce_add_ps(a);
  for (; k < n; ++k) s += x[k] * load1(w + k);
  return s;
}
#else
static inline float load1(const float* p) { return *p; }
static inline float load1(const uint16_t* p) { return bf16_to_f32(*p); }
template <typename T>
static float dot1(const float* x, const T* w, int64_t n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < n; ++k) s += x[k] * load1(w + k);
  return s;
}
template <typename T>
static void dot4(const float* x, const T* w0, const T* w1, const T* w2, const T* w3, int64_t n, float* out) {
  out[0] = dot1(x, w0, n); out[1] = dot1(x, w1, n); out[2] = dot1(x, w2, n); out[3] = dot1(x, w3, n);
}
#endif

template <typename T>
static void linear_few_rows(const float* x, int64_t M, const T* w, int64_t rows, int64_t cols, float* y) {
  int64_t blocks = (rows + 3) / 4;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    int64_t r = b * 4;
    if (r + 4 <= rows) {
      const T* w0 = w + r * cols;
      for (int64_t m = 0; m < M; ++m) {
        float out[4];
        dot4(x + m * cols, w0, w0 + cols, w0 + 2 * cols, w0 + 3 * cols, cols, out);
        for (int i = 0; i < 4; ++i) y[m * rows + r + i] = out[i];
      }
    } else {
      for (; r < rows; ++r)
        for (int64_t m = 0; m < M; ++m) y[m * rows + r] = dot1(x + m * cols, w + r * cols, cols);
    }
  }
}

// Rows of x at or below which the matrix-vector path beats sgemm (W is streamed once per x row).
static constexpr int64_t kFewRows = 4;

void linear(const float* x, int64_t M, const WeightMatrix& W, float* y) {
  if (M <= 0 || W.rows == 0) return;
  if (M <= kFewRows) {
    if (W.dtype == DType::F32) linear_few_rows(x, M, W.f32(), W.rows, W.cols, y);
    else linear_few_rows(x, M, W.bf16(), W.rows, W.cols, y);
    return;
  }
  if (W.dtype == DType::F32) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(W.rows), int(W.cols), 1.f, x, int(W.cols),
                W.f32(), int(W.cols), 0.f, y, int(W.rows));
    return;
  }
  // bf16 weights: widen a block of rows to fp32, then sgemm that block into y's columns. The block
  // is small enough to stay in cache-friendly scratch, so bf16 weights are never held twice.
  const int64_t block = std::max<int64_t>(64, (int64_t(1) << 22) / std::max<int64_t>(1, W.cols));
  std::vector<float> scratch(size_t(std::min(block, W.rows) * W.cols));
  for (int64_t r0 = 0; r0 < W.rows; r0 += block) {
    int64_t nr = std::min(block, W.rows - r0);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < nr; ++r) W.row_to_f32(r0 + r, scratch.data() + r * W.cols);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(nr), int(W.cols), 1.f, x, int(W.cols),
                scratch.data(), int(W.cols), 0.f, y + r0, int(W.rows));
  }
}

}  // namespace meshtune
