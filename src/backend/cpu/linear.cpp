#include "backend/cpu/linear.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "backend/cpu/isa/gemv.h"
#include "backend/cpu/isa/onednn.h"
#include "backend/cpu/int8.h"

namespace meshtune {

// Row r of a bf16 or int8 W as fp32, widened on the path's instruction set.
static void row_to_f32(const KernelPath& path, const WeightMatrix& W, int64_t r, float* out) {
  if (W.dtype == DType::BF16) return widen_bf16(path, W.bf16() + r * W.cols, W.cols, out);
  W.row_to_f32(r, out);
}

// Rows of x at or below which the matrix-vector path beats sgemm (W is streamed once).
static constexpr int64_t kFewRows = 4;

// ---- few-row path (M ≤ 4, decode): W streamed once, one path per instruction set --------------

static void linear_few_rows(const KernelPath& path, const float* x, int64_t M, const WeightMatrix& W, float* y) {
  const bool f32 = W.dtype == DType::F32;
  std::vector<float> scratch(static_cast<size_t>(cpu::gemv_scratch_floats(M, W.cols)));
  float* s = scratch.data();
  switch (path.isa) {
    case CpuPath::Avx512:
    case CpuPath::Avx512Bf16:
      return f32 ? cpu::gemv_f32_avx512(x, M, W.f32(), W.rows, W.cols, y, s)
                 : cpu::gemv_bf16_avx512(x, M, W.bf16(), W.rows, W.cols, y, s);
    case CpuPath::Avx2:
      return f32 ? cpu::gemv_f32_avx2(x, M, W.f32(), W.rows, W.cols, y, s)
                 : cpu::gemv_bf16_avx2(x, M, W.bf16(), W.rows, W.cols, y, s);
    case CpuPath::Generic:
      return f32 ? cpu::gemv_f32_generic(x, M, W.f32(), W.rows, W.cols, y, s)
                 : cpu::gemv_bf16_generic(x, M, W.bf16(), W.rows, W.cols, y, s);
  }
}

void widen_bf16(const KernelPath& path, const uint16_t* src, int64_t n, float* dst) {
  switch (path.isa) {
    case CpuPath::Avx512:
    case CpuPath::Avx512Bf16: return cpu::widen_bf16_avx512(src, n, dst);
    case CpuPath::Avx2: return cpu::widen_bf16_avx2(src, n, dst);
    case CpuPath::Generic: return cpu::widen_bf16_generic(src, n, dst);
  }
}

// Whole arrays are converted in chunks spread over the threads.
static constexpr int64_t kConvertChunk = int64_t(1) << 16;

void narrow_to_bf16(const KernelPath& path, const float* src, int64_t n, uint16_t* dst) {
  const cpu::VectorOps& ops = path.ops();
#pragma omp parallel for schedule(static) if (n > 2 * kConvertChunk)
  for (int64_t begin = 0; begin < n; begin += kConvertChunk)
    ops.narrow_bf16(src + begin, std::min(kConvertChunk, n - begin), dst + begin);
}

void widen_bf16_parallel(const KernelPath& path, const uint16_t* src, int64_t n, float* dst) {
#pragma omp parallel for schedule(static) if (n > 2 * kConvertChunk)
  for (int64_t begin = 0; begin < n; begin += kConvertChunk)
    widen_bf16(path, src + begin, std::min(kConvertChunk, n - begin), dst + begin);
}

// W as bf16: itself unless it is fp32, else a view of its values rounded into `values` (which
// must outlive the view; fp32 weights being trained are rounded at every call, as Keras casts them).
static WeightMatrix bf16_weights(const KernelPath& path, const WeightMatrix& W, std::vector<uint16_t>& values) {
  if (W.dtype != DType::F32) return W;
  values.resize(size_t(W.rows * W.cols));
  narrow_to_bf16(path, W.f32(), W.rows * W.cols, values.data());
  WeightMatrix view = W;
  view.dtype = DType::BF16;
  view.data = values.data();
  view.mapped = false;
  return view;
}

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

static void linear_bf16_gemm(const KernelPath& path, const float* x, int64_t M, const WeightMatrix& W, float* y) {
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    // Row tiles of at most kTileRows, but at least one per thread.
    const int64_t tile_rows = std::min<int64_t>(kTileRows, (W.rows + threads - 1) / threads);
    const int64_t tiles = (W.rows + tile_rows - 1) / tile_rows;
    int64_t b0, b1;
    cpu::thread_share(tiles, t, threads, b0, b1);
    std::vector<float> scratch(b1 > b0 ? size_t(tile_rows * std::min(kTileCols, W.cols)) : 0);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * tile_rows, nr = std::min(tile_rows, W.rows - r0);
      for (int64_t k0 = 0; k0 < W.cols; k0 += kTileCols) {
        const int64_t nk = std::min(kTileCols, W.cols - k0);
        for (int64_t r = 0; r < nr; ++r) widen_bf16(path, W.bf16() + (r0 + r) * W.cols + k0, nk, scratch.data() + r * nk);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(nr), int(nk), 1.f, x + k0, int(W.cols),
                    scratch.data(), int(nk), k0 == 0 ? 0.f : 1.f, y + r0, int(W.rows));
      }
    }
  }
}


// The same product through oneDNN's f32 matmul: a block of W's rows (16 MiB as fp32) widened by all
// threads, then one threaded matmul writes that block's columns of y.
static void linear_widened_onednn(const KernelPath& path, const float* x, int64_t M, const WeightMatrix& W, float* y) {
  const int64_t block = std::max<int64_t>(64, (int64_t(1) << 22) / W.cols);
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(std::min(block, W.rows) * W.cols));
  for (int64_t r0 = 0; r0 < W.rows; r0 += block) {
    const int64_t nr = std::min(block, W.rows - r0);
    widen_bf16_parallel(path, W.bf16() + r0 * W.cols, nr * W.cols, scratch.data());
    cpu::matmul_onednn(false, M, W.cols, nr, x, W.cols, false, scratch.data(), W.cols, true, y + r0, W.rows, false);
  }
}

// ---- bf16 inputs (MatmulPrecision::BF16) --------------------------------------------------------

// The bf16 inputs of a product, kept per thread between calls: `a` (x or dy) as bf16, and as
// those values widened back to fp32 for the paths without bf16 dot products.
struct Bf16Inputs {
  std::vector<uint16_t> a, w;
  std::vector<float> a_rounded;
};

static const uint16_t* narrow_input(const KernelPath& path, const float* a, int64_t n, Bf16Inputs& in) {
  in.a.resize(size_t(n));
  narrow_to_bf16(path, a, n, in.a.data());
  return in.a.data();
}

static const float* rounded_input(const KernelPath& path, const float* a, int64_t n, Bf16Inputs& in) {
  in.a_rounded.resize(size_t(n));
  widen_bf16_parallel(path, narrow_input(path, a, n, in), n, in.a_rounded.data());
  return in.a_rounded.data();
}

void linear(const KernelPath& path, const float* x, int64_t M, const WeightMatrix& W, float* y, MatmulPrecision precision) {
  if (M <= 0 || W.rows == 0) return;
  if (W.cols == 0) {
    std::fill(y, y + M * W.rows, 0.f);
    return;
  }
  if (W.dtype == DType::I8) return linear_int8(path, x, M, W, y);
  if (precision == MatmulPrecision::BF16) {
    thread_local Bf16Inputs in;
    const WeightMatrix Wb = bf16_weights(path, W, in.w);
    if (M > kFewRows && path.uses_onednn(Product::Bf16Linear))
      return cpu::matmul_onednn(true, M, W.cols, W.rows, narrow_input(path, x, M * W.cols, in), W.cols, false, Wb.bf16(),
                                W.cols, true, y, W.rows, false);
    return linear(path, rounded_input(path, x, M * W.cols, in), M, Wb, y);
  }
  if (M <= kFewRows) return linear_few_rows(path, x, M, W, y);
  if (W.dtype == DType::F32 && path.uses_onednn(Product::F32Linear))
    return cpu::matmul_onednn(false, M, W.cols, W.rows, x, W.cols, false, W.f32(), W.cols, true, y, W.rows, false);
  if (W.dtype == DType::F32) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(W.rows), int(W.cols), 1.f, x, int(W.cols),
                W.f32(), int(W.cols), 0.f, y, int(W.rows));
    return;
  }
  if (path.uses_onednn(Product::WidenedLinear)) return linear_widened_onednn(path, x, M, W, y);
  linear_bf16_gemm(path, x, M, W, y);
}

// ---- backward: dx = dy·W and dW = dyᵀ·x, through OpenBLAS or oneDNN ----------------------------------------

void linear_backward_input(const KernelPath& path, const float* dy, int64_t M, const WeightMatrix& W, float* dx, bool accumulate,
                           MatmulPrecision precision) {
  if (precision == MatmulPrecision::BF16 && W.dtype != DType::I8) {
    thread_local Bf16Inputs in;
    const WeightMatrix Wb = bf16_weights(path, W, in.w);
    if (M > kFewRows && path.uses_onednn(Product::Bf16InputGradient))
      return cpu::matmul_onednn(true, M, W.rows, W.cols, narrow_input(path, dy, M * W.rows, in), W.rows, false, Wb.bf16(),
                                W.cols, false, dx, W.cols, accumulate);
    return linear_backward_input(path, rounded_input(path, dy, M * W.rows, in), M, Wb, dx, accumulate);
  }
  if (W.dtype == DType::F32 && M > kFewRows && path.uses_onednn(Product::F32InputGradient))
    return cpu::matmul_onednn(false, M, W.rows, W.cols, dy, W.rows, false, W.f32(), W.cols, false, dx, W.cols, accumulate);
  if (W.dtype == DType::F32) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(W.cols), int(W.rows), 1.f, dy, int(W.rows),
                W.f32(), int(W.cols), accumulate ? 1.f : 0.f, dx, int(W.cols));
    return;
  }
  // bf16 / int8 weights: widen (dequantize) a block of rows (a slice of the contraction) at a time and accumulate.
  const int64_t block = std::max<int64_t>(64, (int64_t(1) << 22) / std::max<int64_t>(1, W.cols));
  std::vector<float> scratch(static_cast<size_t>(std::min(block, W.rows) * W.cols));
  for (int64_t r0 = 0; r0 < W.rows; r0 += block) {
    const int64_t nr = std::min(block, W.rows - r0);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < nr; ++r) row_to_f32(path, W, r0 + r, scratch.data() + r * W.cols);
    const bool add = r0 > 0 || accumulate;
    if (M > kFewRows && path.uses_onednn(Product::WidenedInputGradient))
      cpu::matmul_onednn(false, M, nr, W.cols, dy + r0, W.rows, false, scratch.data(), W.cols, false, dx, W.cols, add);
    else
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(W.cols), int(nr), 1.f, dy + r0, int(W.rows),
                  scratch.data(), int(W.cols), add ? 1.f : 0.f, dx, int(W.cols));
  }
}

void linear_backward_weight(const KernelPath& path, const float* dy, const float* x, int64_t M, int64_t rows, int64_t cols,
                            float* dW) {
  if (M > kFewRows && path.uses_onednn(Product::F32WeightGradient))
    return cpu::matmul_onednn(false, rows, M, cols, dy, rows, true, x, cols, false, dW, cols, true);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(rows), int(cols), int(M), 1.f, dy, int(rows), x, int(cols),
              1.f, dW, int(cols));
}

}  // namespace meshtune
