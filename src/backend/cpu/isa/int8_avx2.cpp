// AVX2 int8 dot products. Codes are sign-extended to int16 (16 per register) and multiplied in
// pairs with vpmaddwd into int32 lanes: exact, since a pair's sum 2·127² fits. Blocks of 4 weight
// rows × up to 2 rows of x keep 8 accumulators in registers; the weight block (4 rows, a few KiB)
// stays in L1 while every row of x passes over it, and the first pass prefetches the next block
// into L2 (the hardware prefetchers stop at 4 KiB pages, two rows of a 2048-wide matrix).
#include <immintrin.h>

#include "backend/cpu/isa/gemv.h"
#include "backend/cpu/isa/int8_dot.h"

namespace meshtune::cpu {

namespace {

constexpr int kRowBlock = 4;

inline __m256i load16(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline int32_t horizontal_sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// y[m·ld + i] for x rows m < M and weight rows i < R of the block at w.
template <int M, int R>
void dot_block(const int8_t* x, const float* xs, const int8_t* w, const float* ws, int64_t cols, float* y,
               int64_t ld, bool prefetch_next) {
  __m256i sum[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) sum[m][i] = _mm256_setzero_si256();
  const char* next = reinterpret_cast<const char*>(w + R * cols);
  const int64_t full = cols / 16 * 16;
  for (int64_t k = 0; k < full; k += 16) {
    if (prefetch_next && k % 64 == 0)
      for (int i = 0; i < R; ++i) _mm_prefetch(next + i * cols + k, _MM_HINT_T1);
    __m256i wv[R];
    for (int i = 0; i < R; ++i) wv[i] = load16(w + i * cols + k);
    for (int m = 0; m < M; ++m) {
      const __m256i xv = load16(x + m * cols + k);
      for (int i = 0; i < R; ++i) sum[m][i] = _mm256_add_epi32(sum[m][i], _mm256_madd_epi16(xv, wv[i]));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) {
      int32_t s = horizontal_sum(sum[m][i]);
      for (int64_t c = full; c < cols; ++c) s += int32_t(x[m * cols + c]) * int32_t(w[i * cols + c]);
      y[m * ld + i] = float(s) / (xs[m] * ws[i]);
    }
}

template <int R>
void row_block(const int8_t* x, int64_t M, const float* xs, const int8_t* w, const float* ws, int64_t rows,
               int64_t cols, float* y, bool prefetch_next) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2)
    dot_block<2, R>(x + m * cols, xs + m, w, ws, cols, y + m * rows, rows, prefetch_next && m == 0);
  if (m < M) dot_block<1, R>(x + m * cols, xs + m, w, ws, cols, y + m * rows, rows, prefetch_next && m == 0);
}

}  // namespace

void dot_int8_avx2(const int8_t* x, int64_t M, const float* x_scales, const int8_t* w, const float* w_scales,
                   int64_t rows, int64_t cols, float* y) {
  for_each_row_block(rows, kRowBlock, [&](int64_t r, int64_t n, bool prefetch) {
    const int8_t* wb = w + r * cols;
    switch (n) {
      case 4: row_block<4>(x, M, x_scales, wb, w_scales + r, rows, cols, y + r, prefetch); break;
      case 3: row_block<3>(x, M, x_scales, wb, w_scales + r, rows, cols, y + r, false); break;
      case 2: row_block<2>(x, M, x_scales, wb, w_scales + r, rows, cols, y + r, false); break;
      default: row_block<1>(x, M, x_scales, wb, w_scales + r, rows, cols, y + r, false); break;
    }
  });
}

}  // namespace meshtune::cpu
