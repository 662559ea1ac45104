// AVX-512 (F, BW) paths of the decode matrix-vector product and of bf16 widening.
//
// Decode is bound by memory bandwidth: each weight is used M ≤ 4 times, a few instructions per
// byte. So the kernel only has to keep both cores' memory streams full:
//  * each thread takes one contiguous stretch of rows and walks it kRowBlock rows at a time; each
//    chunk of W loaded is multiplied into all M rows of x before moving on (x stays in L1/L2), so W
//    is read once whatever M is (the old kernel re-read the rows once per x row);
//  * while it works on one block it prefetches the next block (contiguous after it) into L2, spread
//    evenly over the block's steps. The hardware prefetchers stop at 4 KiB page boundaries, and a
//    bf16 row of 2048 is exactly one page, so without this each row restarted cold; measured +15–25%
//    on the 2048-wide matrices (q, k, v, o, gate, up, and the 256000-row LM head).
//  * bf16: a 64-byte load holds 32 bf16 values; shifting each 32-bit lane left by 16 gives the
//    even-indexed values as fp32, masking off the low 16 bits gives the odd-indexed ones (two cheap
//    in-lane ops). x is rearranged once per call to match (per 32-column chunk: the 16 even columns,
//    then the 16 odd ones), so every product is exact in fp32 as before, only summed in another order.
#include <immintrin.h>

#include "backend/cpu/isa/gemv.h"

// GCC 12 warns falsely inside _mm512_reduce_add_ps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace meshtune::cpu {

namespace {

float widen_one(uint16_t b) { return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(int(uint32_t(b) << 16)))); }

constexpr int kRowBlock = 4;  // weight rows per step: 4·M accumulators (≤ 16 registers)

// x rows as the kernels read them: `kpad` (cols rounded up to 32) floats per row, zero padded, and
// for bf16 weights each 32-column chunk ordered [even columns, odd columns].
void prepare_x(const float* x, int64_t M, int64_t cols, int64_t kpad, bool even_odd, float* xs) {
  for (int64_t i = 0; i < M * kpad; ++i) xs[i] = 0.f;
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * cols;
    float* dst = xs + m * kpad;
    if (!even_odd) {
      for (int64_t c = 0; c < cols; ++c) dst[c] = src[c];
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t chunk = c / 32 * 32, j = c % 32;
      dst[chunk + (j % 2) * 16 + j / 2] = src[c];
    }
  }
}

// The 32 weights of a row at columns k .. k+31 as two fp32 vectors, in prepare_x's order. The masks
// cut off columns past the row's end (masked-off lanes read as zero and never touch memory).
inline void load32(const float* w, int64_t k, __mmask16 m0, __mmask16 m1, __m512& a, __m512& b) {
  a = _mm512_maskz_loadu_ps(m0, w + k);
  b = _mm512_maskz_loadu_ps(m1, w + k + 16);
}
inline void load32(const uint16_t* w, int64_t k, __mmask32 m, __m512& even, __m512& odd) {
  const __m512i v = _mm512_maskz_loadu_epi16(m, w + k);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))));
}

// y[m·ldy + i] = x[m] · W[i] for rows i < R of the block at w, m < M. If `prefetch_next`, the next
// block (the R·cols weights after this one) is prefetched into L2 meanwhile, the same number of
// bytes per step as this block consumes.
template <int M, int R, typename T>
inline void dot_block(const float* xs, int64_t kpad, const T* w, int64_t cols, float* y, int64_t ldy,
                             bool prefetch_next) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) acc[m][i] = _mm512_setzero_ps();
  const char* next = reinterpret_cast<const char*>(w + R * cols);
  constexpr int64_t kStepBytes = R * 32 * int64_t(sizeof(T));
  auto step = [&](int64_t k, auto... mask) {
    if (prefetch_next) {
      const char* p = next + k / 32 * kStepBytes;
      for (int64_t line = 0; line < kStepBytes; line += 64) _mm_prefetch(p + line, _MM_HINT_T1);
    }
    __m512 wa[R], wb[R];
    for (int i = 0; i < R; ++i) load32(w + i * cols, k, mask..., wa[i], wb[i]);
    for (int m = 0; m < M; ++m) {
      const __m512 xa = _mm512_loadu_ps(xs + m * kpad + k), xb = _mm512_loadu_ps(xs + m * kpad + k + 16);
      for (int i = 0; i < R; ++i) acc[m][i] = _mm512_fmadd_ps(xb, wb[i], _mm512_fmadd_ps(xa, wa[i], acc[m][i]));
    }
  };
  const int64_t full = cols / 32 * 32;
  for (int64_t k = 0; k < full; k += 32) {
    if constexpr (sizeof(T) == 4) step(k, __mmask16(0xffff), __mmask16(0xffff));
    else step(k, __mmask32(0xffffffffu));
  }
  if (const int64_t rest = cols - full; rest > 0) {
    if constexpr (sizeof(T) == 4) {
      const __mmask16 m0 = rest >= 16 ? __mmask16(0xffff) : __mmask16((1u << rest) - 1);
      const __mmask16 m1 = rest <= 16 ? __mmask16(0) : __mmask16((1u << (rest - 16)) - 1);
      step(full, m0, m1);
    } else {
      step(full, __mmask32((uint64_t(1) << rest) - 1));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) y[m * ldy + i] = _mm512_reduce_add_ps(acc[m][i]);
}

template <int M, typename T>
void few_rows(const float* xs, int64_t kpad, const T* w, int64_t rows, int64_t cols, float* y) {
  for_each_row_block(rows, kRowBlock, [&](int64_t r, int64_t n, bool prefetch) {
    switch (n) {
      case 4: dot_block<M, 4>(xs, kpad, w + r * cols, cols, y + r, rows, prefetch); break;
      case 3: dot_block<M, 3>(xs, kpad, w + r * cols, cols, y + r, rows, false); break;
      case 2: dot_block<M, 2>(xs, kpad, w + r * cols, cols, y + r, rows, false); break;
      default: dot_block<M, 1>(xs, kpad, w + r * cols, cols, y + r, rows, false); break;
    }
  });
}

template <typename T>
void few_rows_any(const float* x, int64_t M, const T* w, int64_t rows, int64_t cols, float* y, float* xs) {
  const int64_t kpad = (cols + 31) / 32 * 32;
  prepare_x(x, M, cols, kpad, /*even_odd=*/sizeof(T) == 2, xs);
  switch (M) {
    case 1: few_rows<1>(xs, kpad, w, rows, cols, y); break;
    case 2: few_rows<2>(xs, kpad, w, rows, cols, y); break;
    case 3: few_rows<3>(xs, kpad, w, rows, cols, y); break;
    default: few_rows<4>(xs, kpad, w, rows, cols, y); break;
  }
}

}  // namespace

void widen_bf16_avx512(const uint16_t* src, int64_t n, float* dst) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c));
    _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  for (; c < n; ++c) dst[c] = widen_one(src[c]);
}

void gemv_f32_avx512(const float* x, int64_t M, const float* w, int64_t rows, int64_t cols, float* y, float* scratch) {
  few_rows_any(x, M, w, rows, cols, y, scratch);
}

void gemv_bf16_avx512(const float* x, int64_t M, const uint16_t* w, int64_t rows, int64_t cols, float* y,
                      float* scratch) {
  few_rows_any(x, M, w, rows, cols, y, scratch);
}

}  // namespace meshtune::cpu
