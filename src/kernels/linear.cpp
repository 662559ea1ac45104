#include "kernels/linear.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
// GCC 12 warns falsely inside _mm512_reduce_add_ps.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#define MESHTUNE_LINEAR_AVX512 1
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

// Items [begin, end) of n for thread t of `threads`: one contiguous piece per thread, so each thread
// streams its own stretch of W.
static void thread_share(int64_t n, int t, int threads, int64_t& begin, int64_t& end) {
  begin = n * t / threads;
  end = n * (t + 1) / threads;
}

// ---- few-row path (M ≤ 4, decode): W is read from memory exactly once ----------------------------
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

#if MESHTUNE_LINEAR_AVX512
static constexpr int kRowBlock = 4;  // weight rows per step: 4·M accumulators (≤ 16 registers)

// x rows as the kernels read them: `kpad` (cols rounded up to 32) floats per row, zero padded, and
// for bf16 weights each 32-column chunk ordered [even columns, odd columns].
static std::vector<float> prepare_x(const float* x, int64_t M, int64_t cols, int64_t kpad, bool even_odd) {
  std::vector<float> xs(size_t(M * kpad), 0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * cols;
    float* dst = xs.data() + m * kpad;
    if (!even_odd) {
      std::copy(src, src + cols, dst);
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t chunk = c / 32 * 32, j = c % 32;
      dst[chunk + (j % 2) * 16 + j / 2] = src[c];
    }
  }
  return xs;
}

// The 32 weights of a row at columns k .. k+31 as two fp32 vectors, in prepare_x's order. The masks
// cut off columns past the row's end (masked-off lanes read as zero and never touch memory).
static inline void load32(const float* w, int64_t k, __mmask16 m0, __mmask16 m1, __m512& a, __m512& b) {
  a = _mm512_maskz_loadu_ps(m0, w + k);
  b = _mm512_maskz_loadu_ps(m1, w + k + 16);
}
static inline void load32(const uint16_t* w, int64_t k, __mmask32 m, __m512& even, __m512& odd) {
  const __m512i v = _mm512_maskz_loadu_epi16(m, w + k);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))));
}

// y[m·ldy + i] = x[m] · W[i] for rows i < R of the block at w, m < M. If `prefetch_next`, the next
// block (the R·cols weights after this one) is prefetched into L2 meanwhile, the same number of
// bytes per step as this block consumes.
template <int M, int R, typename T>
static inline void dot_block(const float* xs, int64_t kpad, const T* w, int64_t cols, float* y, int64_t ldy,
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
static void few_rows(const float* xs, int64_t kpad, const T* w, int64_t rows, int64_t cols, float* y) {
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
#pragma omp parallel
  {
    int64_t b0, b1;
    thread_share(blocks, omp_get_thread_num(), omp_get_num_threads(), b0, b1);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b * kRowBlock;
      const bool prefetch = b + 1 < b1 && rows - r >= 2 * kRowBlock;  // the next block is this thread's and full
      switch (std::min<int64_t>(kRowBlock, rows - r)) {
        case 4: dot_block<M, 4>(xs, kpad, w + r * cols, cols, y + r, rows, prefetch); break;
        case 3: dot_block<M, 3>(xs, kpad, w + r * cols, cols, y + r, rows, false); break;
        case 2: dot_block<M, 2>(xs, kpad, w + r * cols, cols, y + r, rows, false); break;
        default: dot_block<M, 1>(xs, kpad, w + r * cols, cols, y + r, rows, false); break;
      }
    }
  }
}

template <typename T>
static void linear_few_rows(const float* x, int64_t M, const T* w, int64_t rows, int64_t cols, float* y) {
  const int64_t kpad = (cols + 31) / 32 * 32;
  const std::vector<float> xs = prepare_x(x, M, cols, kpad, /*even_odd=*/sizeof(T) == 2);
  switch (M) {
    case 1: few_rows<1>(xs.data(), kpad, w, rows, cols, y); break;
    case 2: few_rows<2>(xs.data(), kpad, w, rows, cols, y); break;
    case 3: few_rows<3>(xs.data(), kpad, w, rows, cols, y); break;
    default: few_rows<4>(xs.data(), kpad, w, rows, cols, y); break;
  }
}

// bf16 → fp32 for n values.
static void widen(const uint16_t* src, int64_t n, float* dst) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c));
    _mm512_storeu_ps(dst + c, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  for (; c < n; ++c) dst[c] = bf16_to_f32(src[c]);
}
#else
// Portable fallback (no AVX-512): one output at a time.
template <typename T>
static void linear_few_rows(const float* x, int64_t M, const T* w, int64_t rows, int64_t cols, float* y) {
  auto value = [](const T* p) {
    if constexpr (sizeof(T) == 4) return *p;
    else return bf16_to_f32(*p);
  };
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0;
      for (int64_t c = 0; c < cols; ++c) s += x[m * cols + c] * value(w + r * cols + c);
      y[m * rows + r] = s;
    }
}

static void widen(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t c = 0; c < n; ++c) dst[c] = bf16_to_f32(src[c]);
}
#endif

// ---- many-row path (M > 4, prefill): OpenBLAS sgemm ----------------------------------------------
//
// fp32 weights go straight to sgemm (threaded by OpenBLAS; its OpenMP build follows
// omp_get_max_threads, so it uses the same threads as our loops and never oversubscribes).
//
// bf16 weights: each thread takes a contiguous share of W's rows and, tile by tile (kTileRows ×
// kTileCols), widens the tile into its own 256 KiB scratch (stays in its L2) and calls sgemm on it,
// accumulating over the column tiles (beta = 1 after the first). sgemm called inside a parallel
// region runs single-threaded, so there are exactly as many threads as cores. Measured at M = 128
// on the Gemma-2B shapes: ~165 GFLOP/s against ~140 for the previous scheme (widen 2048 rows =
// 16 MiB with all threads, then a threaded sgemm on them), which even beats sgemm on fp32 weights.
// Tiles of 256–512 columns were best; 1024 and more fell back to ~148 GFLOP/s.
static constexpr int64_t kTileRows = 256, kTileCols = 256;

static void linear_bf16_gemm(const float* x, int64_t M, const WeightMatrix& W, float* y) {
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    // Row tiles of at most kTileRows, but at least one per thread.
    const int64_t tile_rows = std::min<int64_t>(kTileRows, (W.rows + threads - 1) / threads);
    const int64_t tiles = (W.rows + tile_rows - 1) / tile_rows;
    int64_t b0, b1;
    thread_share(tiles, t, threads, b0, b1);
    std::vector<float> scratch(b1 > b0 ? size_t(tile_rows * std::min(kTileCols, W.cols)) : 0);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * tile_rows, nr = std::min(tile_rows, W.rows - r0);
      for (int64_t k0 = 0; k0 < W.cols; k0 += kTileCols) {
        const int64_t nk = std::min(kTileCols, W.cols - k0);
        for (int64_t r = 0; r < nr; ++r) widen(W.bf16() + (r0 + r) * W.cols + k0, nk, scratch.data() + r * nk);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(nr), int(nk), 1.f, x + k0, int(W.cols),
                    scratch.data(), int(nk), k0 == 0 ? 0.f : 1.f, y + r0, int(W.rows));
      }
    }
  }
}

// Rows of x at or below which the matrix-vector path beats sgemm (W is streamed once).
static constexpr int64_t kFewRows = 4;

void linear(const float* x, int64_t M, const WeightMatrix& W, float* y) {
  if (M <= 0 || W.rows == 0) return;
  if (W.cols == 0) {
    std::fill(y, y + M * W.rows, 0.f);
    return;
  }
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
  linear_bf16_gemm(x, M, W, y);
}

}  // namespace meshtune
