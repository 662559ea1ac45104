// AVX-512 (F, BW) int8 dot products: int8_avx2.cpp's scheme at 512 bits (32 codes per register,
// sign-extended to int16, vpmaddwd into int32), with masked loads for the last columns. Blocks of
// 4 weight rows × up to 3 rows of x (12 accumulators).
#include <immintrin.h>
#include <omp.h>

#include "kernels/cpu/gemv.h"
#include "kernels/cpu/int8_dot.h"

// GCC 12 warns falsely inside _mm512_reduce_add_epi32.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace meshtune::cpu {

namespace {

constexpr int kRowBlock = 4;

inline __m512i load32(const int8_t* p, __mmask32 mask) { return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, p)); }

template <int M, int R>
void dot_block(const int8_t* x, const int8_t* w, int64_t cols, int32_t* acc, int64_t ld) {
  __m512i sum[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) sum[m][i] = _mm512_setzero_si512();
  auto step = [&](int64_t k, __mmask32 mask) {
    __m512i wv[R];
    for (int i = 0; i < R; ++i) wv[i] = load32(w + i * cols + k, mask);
    for (int m = 0; m < M; ++m) {
      const __m512i xv = load32(x + m * cols + k, mask);
      for (int i = 0; i < R; ++i) sum[m][i] = _mm512_add_epi32(sum[m][i], _mm512_madd_epi16(xv, wv[i]));
    }
  };
  const int64_t full = cols / 32 * 32;
  for (int64_t k = 0; k < full; k += 32) step(k, __mmask32(0xffffffffu));
  if (cols > full) step(full, __mmask32((uint64_t(1) << (cols - full)) - 1));
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) acc[m * ld + i] = _mm512_reduce_add_epi32(sum[m][i]);
}

template <int R>
void row_block(const int8_t* x, int64_t M, const int8_t* w, int64_t rows, int64_t cols, int32_t* acc) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) dot_block<3, R>(x + m * cols, w, cols, acc + m * rows, rows);
  if (M - m == 2) dot_block<2, R>(x + m * cols, w, cols, acc + m * rows, rows);
  if (M - m == 1) dot_block<1, R>(x + m * cols, w, cols, acc + m * rows, rows);
}

}  // namespace

void dot_int8_avx512(const int8_t* x, int64_t M, const int8_t* w, int64_t rows, int64_t cols, int32_t* acc) {
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
