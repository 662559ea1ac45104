// AVX2 int8 dot products. Codes are sign-extended to int16 (16 per register) and multiplied in
// pairs with vpmaddwd into int32 lanes: exact, since 2·127² fits int16 pairs' int32 sum. Blocks
// of 4 weight rows × up to 2 rows of x keep 8 accumulators in registers; the weight block (4 rows,
// a few KiB) stays in L1 while every row of x passes over it.
#include <immintrin.h>
#include <omp.h>

#include "kernels/cpu/gemv.h"
#include "kernels/cpu/int8_dot.h"

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

template <int M, int R>
void dot_block(const int8_t* x, const int8_t* w, int64_t cols, int32_t* acc, int64_t ld) {
  __m256i sum[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) sum[m][i] = _mm256_setzero_si256();
  const int64_t full = cols / 16 * 16;
  for (int64_t k = 0; k < full; k += 16) {
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
      acc[m * ld + i] = s;
    }
}

template <int R>
void row_block(const int8_t* x, int64_t M, const int8_t* w, int64_t rows, int64_t cols, int32_t* acc) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) dot_block<2, R>(x + m * cols, w, cols, acc + m * rows, rows);
  if (m < M) dot_block<1, R>(x + m * cols, w, cols, acc + m * rows, rows);
}

}  // namespace

void dot_int8_avx2(const int8_t* x, int64_t M, const int8_t* w, int64_t rows, int64_t cols, int32_t* acc) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
#pragma omp parallel
  {
    int64_t b0, b1;
    thread_share(blocks, omp_get_thread_num(), omp_get_num_threads(), b0, b1);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b * kRowBlock;
      switch (rows - r < kRowBlock ? rows - r : kRowBlock) {
        case 4: row_block<4>(x, M, w + r * cols, rows, cols, acc + r); break;
        case 3: row_block<3>(x, M, w + r * cols, rows, cols, acc + r); break;
        case 2: row_block<2>(x, M, w + r * cols, rows, cols, acc + r); break;
        default: row_block<1>(x, M, w + r * cols, rows, cols, acc + r); break;
      }
    }
  }
}

}  // namespace meshtune::cpu
