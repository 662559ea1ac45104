// AVX2 + FMA paths of the decode matrix-vector product and of bf16 widening: the AVX-512 design
// (gemv_avx512.cpp: each thread streams its own stretch of rows a block at a time, every loaded
// chunk of W used for all M rows of x, the next block prefetched into L2) at 256 bits. A 32-byte
// load holds 16 bf16 values; shifting each 32-bit lane left by 16 gives the even-indexed ones as
// fp32, masking the low half gives the odd-indexed ones, and x is rearranged once per call to
// match (per 16 columns: the 8 even, then the 8 odd). Columns past the last whole 16 are summed in
// scalar code (AVX2 has no 16-bit masked loads).
#include <immintrin.h>

#include "backend/cpu/isa/gemv.h"

namespace meshtune::cpu {

namespace {

float widen_one(uint16_t b) { return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(int(uint32_t(b) << 16)))); }
float value(const float* p) { return *p; }
float value(const uint16_t* p) { return widen_one(*p); }

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The first `full` columns of each x row as the kernel reads them: as they are for fp32 weights,
// each 16 ordered [even, odd] for bf16.
void prepare_x(const float* x, int64_t M, int64_t cols, int64_t full, float* xs) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < full; ++c) xs[m * full + c / 16 * 16 + (c % 2) * 8 + (c % 16) / 2] = x[m * cols + c];
}

inline void load16(const float* w, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(w);
  b = _mm256_loadu_ps(w + 8);
}
inline void load16(const uint16_t* w, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));
}

// y[m·ldy + i] = x[m] · W[i] for rows i < R of the block at w; xv holds the vector part of x
// (ldx floats per row), x the original rows for the tail.
template <int M, int R, typename T>
void dot_block(const float* xv, int64_t ldx, const float* x, const T* w, int64_t cols, int64_t full, float* y,
               int64_t ldy, bool prefetch_next) {
  __m256 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) acc[m][i] = _mm256_setzero_ps();
  const char* next = reinterpret_cast<const char*>(w + R * cols);
  constexpr int64_t kStepBytes = R * 16 * int64_t(sizeof(T));
  for (int64_t k = 0; k < full; k += 16) {
    if (prefetch_next) {
      const char* p = next + k / 16 * kStepBytes;
      for (int64_t line = 0; line < kStepBytes; line += 64) _mm_prefetch(p + line, _MM_HINT_T1);
    }
    __m256 wa[R], wb[R];
    for (int i = 0; i < R; ++i) load16(w + i * cols + k, wa[i], wb[i]);
    for (int m = 0; m < M; ++m) {
      const __m256 xa = _mm256_loadu_ps(xv + m * ldx + k), xb = _mm256_loadu_ps(xv + m * ldx + k + 8);
      for (int i = 0; i < R; ++i) acc[m][i] = _mm256_fmadd_ps(xb, wb[i], _mm256_fmadd_ps(xa, wa[i], acc[m][i]));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < R; ++i) {
      float s = horizontal_sum(acc[m][i]);
      for (int64_t c = full; c < cols; ++c) s += x[m * cols + c] * value(w + i * cols + c);
      y[m * ldy + i] = s;
    }
}

// Weight rows per block: R·M accumulators stay within the 16 vector registers.
template <int M>
constexpr int kRowBlock = M <= 2 ? 4 : 2;

template <int M, typename T>
void few_rows(const float* xv, int64_t ldx, const float* x, const T* w, int64_t rows, int64_t cols, int64_t full,
              float* y) {
  constexpr int R = kRowBlock<M>;
  for_each_row_block(rows, R, [&](int64_t r, int64_t n, bool prefetch) {
    if (n == R) {
      dot_block<M, R>(xv, ldx, x, w + r * cols, cols, full, y + r, rows, prefetch);
    } else {
      for (int64_t i = 0; i < n; ++i) dot_block<M, 1>(xv, ldx, x, w + (r + i) * cols, cols, full, y + r + i, rows, false);
    }
  });
}

template <typename T>
void gemv_any(const float* x, int64_t M, const T* w, int64_t rows, int64_t cols, float* y, float* scratch) {
  const int64_t full = cols / 16 * 16;
  const float* xv = x;  // fp32 weights read x as it is
  int64_t ldx = cols;
  if constexpr (sizeof(T) == 2) {
    prepare_x(x, M, cols, full, scratch);
    xv = scratch;
    ldx = full;
  }
  switch (M) {
    case 1: few_rows<1>(xv, ldx, x, w, rows, cols, full, y); break;
    case 2: few_rows<2>(xv, ldx, x, w, rows, cols, full, y); break;
    case 3: few_rows<3>(xv, ldx, x, w, rows, cols, full, y); break;
    default: few_rows<4>(xv, ldx, x, w, rows, cols, full, y); break;
  }
}

}  // namespace

void gemv_f32_avx2(const float* x, int64_t M, const float* w, int64_t rows, int64_t cols, float* y, float* scratch) {
  gemv_any(x, M, w, rows, cols, y, scratch);
}

void gemv_bf16_avx2(const float* x, int64_t M, const uint16_t* w, int64_t rows, int64_t cols, float* y,
                    float* scratch) {
  gemv_any(x, M, w, rows, cols, y, scratch);
}

void widen_bf16_avx2(const uint16_t* src, int64_t n, float* dst) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
    _mm256_storeu_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; c < n; ++c) dst[c] = widen_one(src[c]);
}

}  // namespace meshtune::cpu
