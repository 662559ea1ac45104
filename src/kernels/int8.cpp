#include "kernels/int8.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/features.h"
#include "kernels/cpu/int8_dot.h"
#include "kernels/cpu/onednn.h"

namespace meshtune {

// Keras: 127 / (max|v| + 1e-7), float32 add then float32 divide.
float int8_scale(float abs_max) { return 127.0f / (abs_max + 1e-7f); }

static float abs_max(const float* values, int64_t n) {
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(values[i]));
  return m;
}

void row_abs_max(const float* x, int64_t rows, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r) out[r] = abs_max(x + r * cols, cols);
}

void quantize_int8_scaled(const float* values, int64_t n, float s, int8_t* codes) {
  for (int64_t i = 0; i < n; ++i) {
    // nearbyint rounds half to even in the default rounding mode, as np.round does (roundf would not).
    const float q = std::nearbyint(values[i] * s);
    codes[i] = int8_t(std::clamp(q, -127.f, 127.f));
  }
}

float quantize_int8(const float* values, int64_t n, int8_t* codes) {
  const float s = int8_scale(abs_max(values, n));
  quantize_int8_scaled(values, n, s, codes);
  return s;
}

void dequantize_int8(const int8_t* codes, int64_t n, float scale, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = float(codes[i]) / scale;
}

void check_int8_columns(int64_t cols, const std::string& what) {
  check(cols <= kMaxInt8Columns, what, ": an int8 matrix with ", cols, " columns could overflow its int32 sums (at most ",
        kMaxInt8Columns, ")");
}

// An int8 matrix's own memory: its codes [rows, cols] and scales [rows].
struct Int8Storage {
  std::vector<int8_t> codes;
  std::vector<float> scales;
};

std::vector<float> matrix_row_abs_max(const WeightMatrix& W) {
  std::vector<float> maxima(static_cast<size_t>(W.rows));
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(W.cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < W.rows; ++r) {
      W.row_to_f32(r, row.data());
      maxima[size_t(r)] = abs_max(row.data(), W.cols);
    }
  }
  return maxima;
}

WeightMatrix quantize_matrix_int8(const WeightMatrix& W, const float* row_max) {
  check_int8_columns(W.cols, "quantize_matrix_int8");
  auto storage = std::make_shared<Int8Storage>();
  storage->codes.resize(size_t(W.rows) * size_t(W.cols));
  storage->scales.resize(size_t(W.rows));
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(W.cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < W.rows; ++r) {
      W.row_to_f32(r, row.data());
      const float scale = int8_scale(row_max ? row_max[r] : abs_max(row.data(), W.cols));
      quantize_int8_scaled(row.data(), W.cols, scale, storage->codes.data() + r * W.cols);
      storage->scales[size_t(r)] = scale;
    }
  }
  WeightMatrix q;
  q.rows = W.rows;
  q.cols = W.cols;
  q.dtype = DType::I8;
  q.data = storage->codes.data();
  q.scales = storage->scales.data();
  q.owner = storage;
  return q;
}

static bool onednn_enabled = true;
void use_onednn_for_int8(bool use) { onednn_enabled = use; }
// Rows of x at or below which our kernel (W streamed once at memory bandwidth) beats oneDNN.
static constexpr int64_t kFewRows = 4;
bool int8_uses_onednn(int64_t M) { return onednn_enabled && M > kFewRows && cpu::onednn_available(); }

void linear_int8(const float* x, int64_t M, const WeightMatrix& W, float* y, const float* x_row_max) {
  check_int8_columns(W.cols, "linear_int8");
  // Per-thread scratch kept between calls: decode calls this hundreds of times per token.
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> x_scales;
  codes.resize(static_cast<size_t>(M * W.cols));
  x_scales.resize(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * W.cols;
    x_scales[size_t(m)] = int8_scale(x_row_max ? x_row_max[m] : abs_max(row, W.cols));
    quantize_int8_scaled(row, W.cols, x_scales[size_t(m)], codes.data() + m * W.cols);
  }
  if (int8_uses_onednn(M))
    return cpu::dot_int8_onednn(codes.data(), M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, y);
  switch (cpu_path()) {
    case CpuPath::Avx512Bf16:  // implies VNNI
      return cpu::dot_int8_avx512vnni(codes.data(), M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, y);
    case CpuPath::Avx512:
      return cpu::dot_int8_avx512(codes.data(), M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, y);
    case CpuPath::Avx2: return cpu::dot_int8_avx2(codes.data(), M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, y);
    case CpuPath::Generic:
      return cpu::dot_int8_generic(codes.data(), M, x_scales.data(), W.i8(), W.scales, W.rows, W.cols, y);
  }
}

}  // namespace meshtune
