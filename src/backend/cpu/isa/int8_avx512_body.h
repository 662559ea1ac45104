// The AVX-512 (F, BW) int8 dot products, included by int8_avx512.cpp and int8_avx512vnni.cpp —
// each compiled with its own -m flags, each with its own copy (anonymous namespace). The scheme of
// int8_avx2.cpp at 512 bits: 32 codes per register sign-extended to int16, multiplied in pairs into
// int32 lanes — vpmaddwd then vpaddd, or with VNNI one vpdpwssd — and masked loads for the last
// columns. Blocks of 4 weight rows × up to 3 rows of x (12 accumulators); the first pass over a
// block prefetches the next one into L2.
#pragma once
#include <immintrin.h>

#include "backend/cpu/isa/gemv.h"
#include "backend/cpu/isa/int8_dot.h"

// GCC 12 warns falsely inside _mm512_reduce_add_epi32.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace meshtune::cpu {

namespace {

constexpr int kRowBlock = 4;

inline __m512i load32(const int8_t* p, __mmask32 mask) { return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, p)); }

// y[m·ld + i] for x rows m < M and weight rows i < R of the block at w.
template <bool kVnni, int M, int R>
void dot_block(const int8_t* x, const float* xs, const int8_t* w, const float* ws, int64_t cols, float* y,
               int64_t ld, bool prefetch_next) {
  __m512i sum[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) sum[m][i] = _mm512_setzero_si512();
  const char* next = reinterpret_cast<const char*>(w + R * cols);
  auto step = [&](int64_t k, __mmask32 mask) {
    if (prefetch_next && k % 64 == 0)
      for (int i = 0; i < R; ++i) _mm_prefetch(next + i * cols + k, _MM_HINT_T1);
    __m512i wv[R];
    for (int i = 0; i < R; ++i) wv[i] = load32(w + i * cols + k, mask);
    for (int m = 0; m < M; ++m) {
      const __m512i xv = load32(x + m * cols + k, mask);
      for (int i = 0; i < R; ++i) {
        if constexpr (kVnni) sum[m][i] = _mm512_dpwssd_epi32(sum[m][i], xv, wv[i]);
        else sum[m][i] = _mm512_add_epi32(sum[m][i], _mm512_madd_epi16(xv, wv[i]));
      }
    }
  };
  const int64_t full = cols / 32 * 32;
  for (int64_t k = 0; k < full; k += 32) step(k, __mmask32(0xffffffffu));
  if (cols > full) step(full, __mmask32((uint64_t(1) << (cols - full)) - 1));
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) y[m * ld + i] = float(_mm512_reduce_add_epi32(sum[m][i])) / (xs[m] * ws[i]);
}

template <bool kVnni, int R>
void row_block(const int8_t* x, int64_t M, const float* xs, const int8_t* w, const float* ws, int64_t rows,
               int64_t cols, float* y, bool prefetch_next) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3)
    dot_block<kVnni, 3, R>(x + m * cols, xs + m, w, ws, cols, y + m * rows, rows, prefetch_next && m == 0);
  if (M - m == 2) dot_block<kVnni, 2, R>(x + m * cols, xs + m, w, ws, cols, y + m * rows, rows, prefetch_next && m == 0);
  if (M - m == 1) dot_block<kVnni, 1, R>(x + m * cols, xs + m, w, ws, cols, y + m * rows, rows, prefetch_next && m == 0);
}

template <bool kVnni>
void dot_int8(const int8_t* x, int64_t M, const float* x_scales, const int8_t* w, const float* w_scales, int64_t rows,
              int64_t cols, float* y) {
  for_each_row_block(rows, kRowBlock, [&](int64_t r, int64_t n, bool prefetch) {
    const int8_t* wb = w + r * cols;
    switch (n) {
      case 4: row_block<kVnni, 4>(x, M, x_scales, wb, w_scales + r, rows, cols, y + r, prefetch); break;
      case 3: row_block<kVnni, 3>(x, M, x_scales, wb, w_scales + r, rows, cols, y + r, false); break;
      case 2: row_block<kVnni, 2>(x, M, x_scales, wb, w_scales + r, rows, cols, y + r, false); break;
      default: row_block<kVnni, 1>(x, M, x_scales, wb, w_scales + r, rows, cols, y + r, false); break;
    }
  });
}

}  // namespace

}  // namespace meshtune::cpu
