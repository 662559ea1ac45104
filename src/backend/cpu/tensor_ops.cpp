#include "backend/cpu/tensor_ops.h"

#include <algorithm>

namespace meshtune {

void copy_values(const float* src, int64_t n, float* dst) { std::copy(src, src + n, dst); }

void fill_zeros(float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] = 0.f;
}

void add_into(float* x, const float* y, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void scale_in_place(float* x, int64_t n, float factor) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}


void embedding_lookup(const WeightMatrix& table, int64_t first_row, const int32_t* ids, int64_t M, float factor,
                      float* out) {
  const int64_t D = table.cols;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t row = int64_t(ids[m]) - first_row;
    float* y = out + m * D;
    if (row < 0 || row >= table.rows) {
      std::fill(y, y + D, 0.f);
      continue;
    }
    table.row_to_f32(row, y);  // widened (and dequantized) first, then scaled: two roundings
    if (factor != 1.f)
      for (int64_t i = 0; i < D; ++i) y[i] *= factor;
  }
}

void embedding_lookup_backward(const float* dy, const int32_t* ids, int64_t M, int64_t dim, int64_t first_row,
                               int64_t rows, float factor, float* grad) {
  for (int64_t m = 0; m < M; ++m) {
    const int64_t row = int64_t(ids[m]) - first_row;
    if (row < 0 || row >= rows) continue;  // another process' row
    float* g = grad + row * dim;
    const float* d = dy + m * dim;
    for (int64_t i = 0; i < dim; ++i) g[i] += d[i] * factor;
  }
}

void write_cache_rows(const float* values, int64_t B, int64_t T, int64_t width, int64_t capacity, int64_t start,
                      float* cache) {
  for (int64_t b = 0; b < B; ++b)
    std::copy(values + b * T * width, values + (b + 1) * T * width, cache + (b * capacity + start) * width);
}

void gather_rows(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) {
  for (int64_t i = 0; i < n; ++i) std::copy_n(src + rows[i] * dim, dim, dst + i * dim);
}

void scatter_rows(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst) {
  for (int64_t i = 0; i < n; ++i) std::copy_n(src + i * dim, dim, dst + rows[i] * dim);
}

void interleave_column_blocks(const float* blocks, int parts, int64_t M, int64_t part, float* out) {
  for (int r = 0; r < parts; ++r)
    for (int64_t m = 0; m < M; ++m)
      std::copy_n(blocks + (int64_t(r) * M + m) * part, part, out + m * parts * part + r * part);
}

}  // namespace meshtune
