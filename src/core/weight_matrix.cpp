#include "core/weight_matrix.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace meshtune {

// The loops here prepare weights on the host once, at load or export; they are threaded (a 7B
// model has billions of values to round or quantize) but are not per-step compute, which belongs
// to the backends.

void WeightMatrix::row_to_f32(int64_t r, float* out) const {
  const size_t first = size_t(r) * size_t(cols);
  switch (dtype) {
    case DType::BF16:
      for (int64_t c = 0; c < cols; ++c) out[c] = bf16_to_f32(bf16()[first + size_t(c)]);
      return;
    case DType::I8: return dequantize_int8(i8() + first, cols, scales[r], out);
    default: std::copy(f32() + first, f32() + first + size_t(cols), out);
  }
}

std::vector<float> WeightMatrix::to_f32() const {
  std::vector<float> out(static_cast<size_t>(rows * cols));
#pragma omp parallel for schedule(static) if (rows * cols > (int64_t(1) << 20))
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

WeightVector::WeightVector(std::vector<float> host) : storage_(std::make_shared<FloatBuffer>(host.size())) {
  std::copy(host.begin(), host.end(), storage_->data());
}

std::vector<float> WeightVector::to_f32() const {
  check(device() == Device::Host, "a weight vector in ", device_name(device()), " memory is read on the host");
  return std::vector<float>(data(), data() + size());
}

WeightMatrix to_bf16_matrix(const WeightMatrix& W) {
  if (W.dtype != DType::F32) return W;
  auto values = std::make_shared<std::vector<uint16_t>>(size_t(W.rows) * size_t(W.cols));
  const float* src = W.f32();
  uint16_t* dst = values->data();
  const int64_t n = W.rows * W.cols;
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 20))
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  WeightMatrix b = W;
  b.dtype = DType::BF16;
  b.data = values->data();
  b.owner = values;
  b.mapped = false;
  return b;
}

// Keras: 127 / (max|v| + 1e-7), float32 add then float32 divide.
float int8_scale(float abs_max) { return 127.0f / (abs_max + 1e-7f); }

float abs_max(const float* values, int64_t n) {
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(values[i]));
  return m;
}

void quantize_int8_scaled(const float* values, int64_t n, float s, int8_t* codes) {
  // Keras: clip(round(v·s), -127, 127), rounding half to even as np.round does. Clipping first gives
  // the same codes (what rounds beyond ±127 clips to ±127 either way), and for |x| ≤ 127 adding and
  // then subtracting 1.5·2²³ rounds x to an integer, ties to even, in the default rounding mode — as
  // nearbyint does, without a libm call per value (a 7B model's 8.5 billion at load; GCC keeps
  // this loop scalar, with branches for the clipped values, and it is still 1.85× faster overall).
  constexpr float kRoundToInteger = 12582912.f;  // 1.5 · 2^23
  for (int64_t i = 0; i < n; ++i) {
    const float clipped = std::min(std::max(values[i] * s, -127.f), 127.f);
    codes[i] = int8_t((clipped + kRoundToInteger) - kRoundToInteger);
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
  HostTensor codes;  // large ones from mmap: zero pages, not a memset the quantization overwrites
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
  storage->codes = HostTensor::allocate(DType::I8, {W.rows, W.cols});
  int8_t* codes = storage->codes.mutable_as<int8_t>();
  storage->scales.resize(size_t(W.rows));
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(W.cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < W.rows; ++r) {
      W.row_to_f32(r, row.data());
      const float scale = int8_scale(row_max ? row_max[r] : abs_max(row.data(), W.cols));
      quantize_int8_scaled(row.data(), W.cols, scale, codes + r * W.cols);
      storage->scales[size_t(r)] = scale;
    }
  }
  WeightMatrix q;
  q.rows = W.rows;
  q.cols = W.cols;
  q.dtype = DType::I8;
  q.data = storage->codes.data;
  q.scales = storage->scales.data();
  q.owner = storage;
  return q;
}

}  // namespace meshtune
